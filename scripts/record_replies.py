# Records raw reply bytes from a real redis-server for the differential test.
import socket, sys
port = int(sys.argv[1]); out = sys.argv[2]
cmds = [["FLUSHALL"], ["SET", "k", "v"], ["GET", "k"], ["GET", "missing"], ["INCR", "n"], ["RPUSH", "l", "a", "b", "", "x"*300],
        ["LRANGE", "l", "0", "-1"], ["HSET", "h", "f1", "v1", "f2", "v2"], ["HGETALL", "h"], ["SADD", "s", "m"], ["SMEMBERS", "s"],
        ["ZADD", "z", "1.5", "a", "2", "b"], ["ZRANGE", "z", "0", "-1", "WITHSCORES"], ["XADD", "st", "1-1", "f", "v"], ["XRANGE", "st", "-", "+"],
        ["NOSUCHCMD"], ["LPUSH", "k", "x"], ["MGET", "k", "missing", "n"], ["EXISTS", "k", "l"], ["TYPE", "h"], ["PING"], ["ECHO", "a\r\nb"],
        ["CONFIG", "GET", "maxmemory"], ["COMMAND", "INFO", "get", "set"], ["SCAN", "0"], ["OBJECT", "ENCODING", "l"], ["EXEC"], ["MULTI"], ["INCR", "n"], ["EXEC"],
        ["DEL", "k"], ["INFO", "server"], ["CLIENT", "INFO"], ["SLOWLOG", "GET", "2"], ["TTL", "k"]]
def enc(c):
    b = b"*%d\r\n" % len(c)
    for a in c:
        a = a.encode(); b += b"$%d\r\n%s\r\n" % (len(a), a)
    return b
s = socket.create_connection(("127.0.0.1", port)); s.sendall(b"".join(enc(c) for c in cmds) + enc(["PING"]))
data = b""
s.settimeout(1)
try:
    while True:
        d = s.recv(65536)
        if not d: break
        data += d
except socket.timeout: pass
open(out, "wb").write(data)
print(len(data))
