// libFuzzer target: the whole config load path on arbitrary bytes, as keyguard runs it on a file:
// read the file (ReadConfigText), YAML text -> proto (YamlTextToProto), proto -> compiled config
// (Compile: key policy, hygiene, tenancy with its users file, upstream auth), then DescribeConfig.
//
// Input: the config text, optionally followed by a line "#@users" and the users file's text. In
// the config, @USERS@ stands for the users file's path (`tenancy: {users_file: "@USERS@"}`).
// Every outcome must be a status or a config: no crash, no exception, no leak, no hang; an error
// names the file and, JSON-escaped, is one printable line.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_replace.h"
#include "keyguard/config/config.h"
#include "keyguard/config/config_store.h"
#include "keyguard/hygiene/detectors.h"

namespace {

std::string dir;
std::string config_path;
std::string users_path;

void WriteFile(const std::string& path, std::string_view text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) __builtin_trap();
  if (!text.empty() && std::fwrite(text.data(), 1, text.size(), f) != text.size()) __builtin_trap();
  std::fclose(f);
}

void RemoveDir() { std::filesystem::remove_all(dir); }

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  char tmpl[] = "/tmp/keyguard-config-fuzz-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) __builtin_trap();
  dir = tmpl;
  config_path = dir + "/keyguard.yaml";
  users_path = dir + "/users.yaml";
  std::atexit(RemoveDir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  constexpr std::string_view kSplit = "#@users\n";
  const size_t split = input.find(kSplit);
  const std::string_view users = split == std::string_view::npos ? "" : input.substr(split + kSplit.size());
  const std::string_view text = split == std::string_view::npos ? input : input.substr(0, split);
  const std::string config =
      absl::StrReplaceAll(absl::string_view(text.data(), text.size()), {{"@USERS@", users_path}});
  WriteFile(config_path, config);
  WriteFile(users_path, users);

  auto loaded = keyguard::config::LoadConfigFile(config_path);
  if (!loaded.ok()) {
    const std::string message(loaded.status().message());
    if (message.rfind(config_path + ": ", 0) != 0) __builtin_trap();  // every error names the file
    for (const char c : keyguard::hygiene::JsonEscape(message)) {
      if (c < 0x20 || c > 0x7e) __builtin_trap();  // the log line stays one printable line
    }
    return 0;
  }
  if (!keyguard::config::Validate(*loaded).ok()) {
    // A file without `upstream:` may set upstream_tls or sentinel for the --upstream given on
    // the command line (main() checks them then): the rest must hold.
    keyguard::config::ProxyConfig plain = *loaded;
    plain.upstream_tls = keyguard::config::TlsSettings();
    plain.sentinel = keyguard::config::SentinelSettings();
    if (!keyguard::config::Validate(plain).ok()) __builtin_trap();
  }
  const std::string described = keyguard::config::DescribeConfig(*loaded);
  if (described.empty()) __builtin_trap();
  return 0;
}
