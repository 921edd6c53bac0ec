#!/bin/sh
# The compose demo's TLS certificates, made at `compose up` by the one-shot `certs` service into
# the shared `certs` volume (nothing private is committed):
#   ca.crt                    a throwaway CA (its key is deleted once it has signed)
#   redis.crt, redis.key      redis-tls's server certificate: subjectAltName DNS:redis-tls (the
#                             name keyguard-tls verifies), DNS:localhost, IP:127.0.0.1
# usage: make-certs.sh DIR [OWNER]
#   OWNER (uid:gid): who gets redis.key (mode 0600); the redis image runs redis-server as 999.
# Files that are there and still verify are kept, so a second `compose up` does not swap the CA
# under a running redis-tls. tests/e2e/test_packaging.py runs this script and serves TLS with it.
set -eu
dir=${1:?usage: make-certs.sh DIR [OWNER]}
owner=${2:-}
days=365
mkdir -p "$dir"
cd "$dir"
if [ -s ca.crt ] && [ -s redis.key ] && openssl verify -CAfile ca.crt redis.crt >/dev/null 2>&1; then
  echo "make-certs: $dir: certificates present and valid, kept"
  exit 0
fi
umask 077
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
# shellcheck disable=SC2086  # $ec is several words
openssl req -x509 $ec -days "$days" -keyout ca.key -out ca.crt -subj "/CN=keyguard demo CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
# shellcheck disable=SC2086
openssl req $ec -keyout redis.key -out redis.csr -subj "/CN=redis-tls" 2>/dev/null
printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
  "extendedKeyUsage=serverAuth" "subjectAltName=DNS:redis-tls,DNS:localhost,IP:127.0.0.1" >redis.ext
openssl x509 -req -in redis.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" -out redis.crt \
  -extfile redis.ext 2>/dev/null
rm -f ca.key ca.srl redis.csr redis.ext
chmod 0644 ca.crt redis.crt
chmod 0600 redis.key
if [ -n "$owner" ]; then
  chown "$owner" redis.key
fi
openssl verify -CAfile ca.crt redis.crt >/dev/null
echo "make-certs: $dir: ca.crt, redis.crt (redis-tls, localhost, 127.0.0.1), redis.key"
