// The upstream URL: "HOST:PORT", redis://, rediss://, redis-sentinel://, rediss-sentinel://,
// redis-cluster://, rediss-cluster://.
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "keyguard/common/field_error.h"
#include "keyguard/config/config.h"

namespace keyguard::config {
namespace {

constexpr std::string_view kPasswordRefused =
    "a password in the URL is refused: put it in the file named by upstream_auth.password_file (or "
    "sentinel.password_file for the Sentinels)";

}  // namespace

std::string Upstream::ToString() const {
  if (kind == Kind::kSentinel) {
    std::vector<std::string> list;
    for (const HostPort& s : sentinels) list.push_back(s.ToString());
    return absl::StrCat(tls ? "rediss" : "redis", "-sentinel://", master, "@", absl::StrJoin(list, ","));
  }
  if (kind == Kind::kCluster) {
    std::vector<std::string> list;
    for (const HostPort& s : seeds) list.push_back(s.ToString());
    return absl::StrCat(tls ? "rediss" : "redis", "-cluster://", user, user.empty() ? "" : "@",
                        absl::StrJoin(list, ","));
  }
  if (!tls && user.empty()) return address.ToString();
  return absl::StrCat(tls ? "rediss" : "redis", "://", user, user.empty() ? "" : "@", address.ToString());
}

bool TlsSettings::customized() const {
  const TlsSettings d;
  return ca_file != d.ca_file || ca_dir != d.ca_dir || cert_file != d.cert_file || key_file != d.key_file ||
         server_name != d.server_name || verify != d.verify || min_version != d.min_version || ciphers != d.ciphers ||
         ciphersuites != d.ciphersuites;
}

absl::StatusOr<Upstream> ParseUpstream(std::string_view text_in, std::string_view field_in) {
  const absl::string_view text(text_in.data(), text_in.size());
  const std::string field(field_in);
  Upstream u;
  const size_t scheme_end = text.find("://");
  if (scheme_end == absl::string_view::npos) {
    auto hp = ParseHostPort(text_in, field_in);
    if (!hp.ok()) return hp.status();
    u.address = *std::move(hp);
    return u;
  }
  const absl::string_view scheme = text.substr(0, scheme_end);
  absl::string_view rest = text.substr(scheme_end + 3);
  if (scheme == "redis" || scheme == "rediss") {
    u.tls = scheme == "rediss";
  } else if (scheme == "redis-sentinel" || scheme == "rediss-sentinel") {
    u.kind = Upstream::Kind::kSentinel;
    u.tls = scheme == "rediss-sentinel";
  } else if (scheme == "redis-cluster" || scheme == "rediss-cluster") {
    u.kind = Upstream::Kind::kCluster;
    u.tls = scheme == "rediss-cluster";
  } else {
    return FieldError(field, absl::StrCat("unknown scheme '", scheme,
                                          "://' (use HOST:PORT, redis://, rediss://, redis-sentinel:// or "
                                          "rediss-sentinel://)"));
  }
  // The userinfo ends at the last '@' (a host has none). Its ':' would start a password: refused,
  // and the text is not repeated in the error (it holds the secret).
  const size_t at = rest.rfind('@');
  absl::string_view userinfo;
  if (at != absl::string_view::npos) {
    userinfo = rest.substr(0, at);
    rest = rest.substr(at + 1);
    if (absl::StrContains(userinfo, ':')) return FieldError(field, kPasswordRefused);
  }
  if (absl::StrContains(rest, '/') || absl::StrContains(rest, '?')) {
    return FieldError(field, absl::StrCat("'", text, "': nothing may follow HOST:PORT (no database, no options: ",
                                          "they belong in the config file)"));
  }
  if (u.kind == Upstream::Kind::kDirect) {
    if (at != absl::string_view::npos && userinfo.empty()) {
      return FieldError(field, absl::StrCat("'", text, "': empty user before '@'"));
    }
    u.user = std::string(userinfo);
    auto hp = ParseHostPort(AsStd(rest), field_in);
    if (!hp.ok()) return hp.status();
    u.address = *std::move(hp);
    return u;
  }
  if (u.kind == Upstream::Kind::kCluster) {
    if (at != absl::string_view::npos && userinfo.empty()) {
      return FieldError(field, absl::StrCat("'", text, "': empty user before '@'"));
    }
    u.user = std::string(userinfo);
    for (absl::string_view s : absl::StrSplit(rest, ',')) {
      auto hp = ParseHostPort(AsStd(s), absl::StrCat(field, " (seed ", u.seeds.size() + 1, ")"));
      if (!hp.ok()) return hp.status();
      u.seeds.push_back(*std::move(hp));
    }
    u.address = u.seeds.front();
    return u;
  }
  if (userinfo.empty()) {
    return FieldError(field,
                      absl::StrCat("'", text, "' names no master: ", scheme, "://MASTER@HOST:PORT[,HOST:PORT...]"));
  }
  u.master = std::string(userinfo);
  for (absl::string_view s : absl::StrSplit(rest, ',')) {
    auto hp = ParseHostPort(AsStd(s), absl::StrCat(field, " (Sentinel ", u.sentinels.size() + 1, ")"));
    if (!hp.ok()) return hp.status();
    u.sentinels.push_back(*std::move(hp));
  }
  return u;
}

}  // namespace keyguard::config
