#include "proxy/credentials.h"

#include <cstdio>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "config/yaml_proto.h"
#include "keyguard/common/json_line.h"
#include "keyguard/common/views.h"
#include "keyguard/resp/encoder.h"

namespace keyguard::proxy {

UpstreamCredentials::UpstreamCredentials(const config::ProxyConfig& config)
    : UpstreamCredentials("upstream_auth", config.UpstreamUser(), config.upstream_auth.password,
                          config.upstream_auth.password_file) {}

UpstreamCredentials::UpstreamCredentials(std::string what, std::string user, std::string password, std::string file)
    : what_(std::move(what)),
      user_(std::move(user)),
      file_(std::move(file)),
      current_(Encode(password)),
      password_(std::move(password)),
      stamp_(FileStamp::Of(file_)) {}

std::shared_ptr<const std::string> UpstreamCredentials::Encode(const std::string& password) const {
  auto auth = std::make_shared<std::string>();
  if (password.empty()) return auth;
  std::vector<std::string_view> args = {"AUTH"};
  if (!user_.empty()) args.push_back(user_);
  args.push_back(password);
  resp::AppendCommand(auth.get(), args);
  return auth;
}

std::shared_ptr<const std::string> UpstreamCredentials::Current() {
  std::lock_guard<std::mutex> lock(mu_);
  Refresh();
  return current_;
}

std::string UpstreamCredentials::Password() {
  std::lock_guard<std::mutex> lock(mu_);
  Refresh();
  return password_;
}

void UpstreamCredentials::Refresh() {
  if (file_.empty()) return;
  const FileStamp stamp = FileStamp::Of(file_);
  if (stamp == stamp_) return;
  stamp_ = stamp;
  auto text = config::ReadConfigText(file_);
  std::string password = text.ok() ? *std::move(text) : std::string();
  while (!password.empty() && (password.back() == '\n' || password.back() == '\r')) password.pop_back();
  if (password.empty()) {
    // Mid-rotation (the file not yet written): the next change tries again.
    EventLine("error", absl::StrCat(what_, "_reload_failed"))
        .Str("file", file_)
        .Str("error", text.ok() ? "the file is empty" : AsStd(text.status().message()))
        .Write(stderr);
    return;
  }
  current_ = Encode(password);
  password_ = std::move(password);
  ++reloads_;
  EventLine("info", absl::StrCat(what_, "_reloaded"))
      .Str("file", file_)
      .Int("reloads", static_cast<int64_t>(reloads_))
      .Write(stderr);
}

uint64_t UpstreamCredentials::reloads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reloads_;
}

}  // namespace keyguard::proxy
