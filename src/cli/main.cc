// keyguard: a RESP proxy that keeps Redis key names in order.
//   keyguard [--config FILE] [--listen HOST:PORT] [--upstream HOST:PORT] [--admin HOST:PORT] [--threads N]
//   keyguard check-config FILE
//   keyguard audit ... | keyguard migrate ...   (src/maintenance)
// Flags override the same settings from the config file.
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "keyguard/config/config.h"
#include "keyguard/config/config_store.h"
#include "keyguard/hygiene/detectors.h"
#include "keyguard/maintenance/maintenance.h"
#include "keyguard/proxy/server.h"

namespace {

constexpr char kUsage[] =
    "usage: keyguard [options]            run the proxy\n"
    "       keyguard check-config FILE    validate a config file and print the effective settings\n"
    "       keyguard audit [options]      report what the keys already in Redis break (audit --help)\n"
    "       keyguard migrate --migration NAME copy|verify|cleanup [options]\n"
    "                                     rename or re-shape existing keys (migrate --help)\n"
    "\n"
    "options (each overrides the same setting in --config):\n"
    "  --config FILE         YAML config file\n"
    "  --listen HOST:PORT    where clients connect (default 127.0.0.1:6380)\n"
    "  --upstream HOST:PORT  the Redis server (default 127.0.0.1:6379)\n"
    "  --admin HOST:PORT     HTTP /metrics, /healthz, /readyz (default 127.0.0.1:9121)\n"
    "  --threads N           worker threads (default: one per hardware thread)\n"
    "  --help, --version\n";

// The subcommands (check-config, audit, migrate) write for people: "keyguard: PATH: field: what".
int Fail(const std::string& message) {
  std::fprintf(stderr, "keyguard: %s\n", message.c_str());
  return 2;
}

// The proxy logs JSON lines only, start-up failures included (a log pipeline parses every line).
int FailToStart(const std::string& message) {
  keyguard::EventLine("error", "startup_failed").Str("error", message).Write(stderr);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using keyguard::config::ProxyConfig;
  std::signal(SIGPIPE, SIG_IGN);
  std::vector<std::string> args(argv + 1, argv + argc);

  if (!args.empty() && args[0] == "check-config") {
    if (args.size() != 2) return Fail("usage: keyguard check-config FILE");
    auto c = keyguard::config::LoadConfigFile(args[1]);
    if (!c.ok()) return Fail(std::string(c.status().message()));
    std::fputs(keyguard::config::DescribeConfig(*c).c_str(), stdout);
    return 0;
  }
  if (!args.empty() && args[0] == "audit") return keyguard::maintenance::RunAudit({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "migrate") return keyguard::maintenance::RunMigrate({args.begin() + 1, args.end()});
  if (!args.empty() && args[0].rfind("--", 0) != 0) return Fail(absl::StrCat("unknown subcommand '", args[0], "'\n", kUsage));

  std::map<std::string, std::string> flags;
  const std::vector<std::string> valued = {"--config", "--listen", "--upstream", "--admin", "--threads"};
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--version") {
      std::printf("keyguard %s\n", KEYGUARD_VERSION);
      return 0;
    }
    std::string name = a, value;
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
    }
    if (std::find(valued.begin(), valued.end(), name) == valued.end()) return FailToStart(absl::StrCat("unknown flag '", name, "' (keyguard --help lists them)"));
    if (eq == std::string::npos) {
      if (i + 1 >= args.size()) return FailToStart(absl::StrCat(name, " needs a value"));
      value = args[++i];
    }
    flags[name] = value;
  }

  ProxyConfig config;
  if (flags.count("--config")) {
    auto c = keyguard::config::LoadConfigFile(flags["--config"]);
    if (!c.ok()) return FailToStart(std::string(c.status().message()));
    config = *c;
  }
  for (auto [flag, target] : {std::pair{"--listen", &config.listen}, std::pair{"--upstream", &config.upstream},
                              std::pair{"--admin", &config.admin}}) {
    if (!flags.count(flag)) continue;
    auto hp = keyguard::config::ParseHostPort(flags[flag], flag);
    if (!hp.ok()) return FailToStart(std::string(hp.status().message()));
    *target = *hp;
  }
  if (flags.count("--threads")) {
    int n;
    if (!absl::SimpleAtoi(flags["--threads"], &n) || n < 0 || n > 256) return FailToStart("--threads: expected 0..256");
    config.threads = n;
  }
  if (auto s = keyguard::config::Validate(config); !s.ok()) return FailToStart(std::string(s.message()));
  auto status = keyguard::proxy::RunServer(config, flags.count("--config") ? flags["--config"] : "");
  if (!status.ok()) return FailToStart(std::string(status.message()));
  return 0;
}
