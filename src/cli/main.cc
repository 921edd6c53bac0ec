// keyguard: a RESP proxy that keeps Redis key names in order.
//   keyguard [--config FILE] [--listen HOST:PORT] [--upstream URL] [--admin HOST:PORT] [--threads N]
//   keyguard check-config FILE
//   keyguard audit ... | keyguard migrate ...   (src/maintenance)
// Flags override the same settings from the config file.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "keyguard/config/config.h"
#include "keyguard/config/config_store.h"
#include "keyguard/hygiene/detectors.h"
#include "keyguard/maintenance/maintenance.h"
#include "keyguard/proxy/server.h"
#include "maintenance/args.h"

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
    "  --upstream URL        the Redis server (default 127.0.0.1:6379): HOST:PORT,\n"
    "                        redis://[USER@]HOST:PORT, rediss://[USER@]HOST:PORT (TLS),\n"
    "                        redis-sentinel://MASTER@HOST:PORT,... or rediss-sentinel://...\n"
    "  --admin HOST:PORT     HTTP /metrics, /healthz, /readyz (default 127.0.0.1:9121)\n"
    "  --threads N           worker threads (default: one per hardware thread)\n"
    "  --upstream-connections dedicated|shared\n"
    "                        one upstream connection per client (default), or each worker's\n"
    "                        shared pipelined connections, pinning clients with connection state\n"
    "  --help, --version\n";

// The subcommands (check-config, audit, migrate) write for people: "keyguard: PATH: field: what".
int Fail(const std::string& message) { return keyguard::maintenance::UsageError("keyguard", message); }

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
  if (!args.empty() && args[0].rfind("--", 0) != 0)
    return Fail(absl::StrCat("unknown subcommand '", args[0], "'\n", kUsage));

  if (std::find(args.begin(), args.end(), "-h") != args.end()) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  auto parsed = keyguard::maintenance::ParseArgs(
      args, {"--config", "--listen", "--upstream", "--admin", "--threads", "--upstream-connections"},
      {"--help", "--version"});
  if (!parsed.ok()) {
    std::string message(parsed.status().message());
    if (message.rfind("unknown flag", 0) == 0) message += " (keyguard --help lists them)";
    return FailToStart(message);
  }
  const keyguard::maintenance::Args& flags = *parsed;
  if (flags.Has("--help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (flags.Has("--version")) {
    std::printf("keyguard %s\n", KEYGUARD_VERSION);
    return 0;
  }
  if (!flags.positional.empty()) return FailToStart(absl::StrCat("unexpected argument '", flags.positional[0], "'"));

  ProxyConfig config;
  if (flags.Has("--config")) {
    auto c = keyguard::config::LoadConfigFile(flags.Str("--config"));
    if (!c.ok()) return FailToStart(std::string(c.status().message()));
    config = *c;
  }
  if (flags.Has("--upstream")) {
    auto u = keyguard::config::ParseUpstream(flags.Str("--upstream"), "--upstream");
    if (!u.ok()) return FailToStart(std::string(u.status().message()));
    config.upstream = *u;
  }
  for (auto [flag, target] : {std::pair{"--listen", &config.listen}, std::pair{"--admin", &config.admin}}) {
    if (!flags.Has(flag)) continue;
    auto hp = keyguard::config::ParseHostPort(flags.Str(flag), flag);
    if (!hp.ok()) return FailToStart(std::string(hp.status().message()));
    *target = *hp;
  }
  if (flags.Has("--threads")) {
    auto n = flags.Int("--threads", 0, 0, 256);
    if (!n.ok()) return FailToStart(std::string(n.status().message()));
    config.threads = static_cast<int>(*n);
  }
  if (flags.Has("--upstream-connections")) {
    const std::string mode = flags.Str("--upstream-connections");
    if (mode != "dedicated" && mode != "shared") {
      return FailToStart(absl::StrCat("--upstream-connections: '", mode, "' is not one of dedicated, shared"));
    }
    config.shared_upstream = mode == "shared";
    if (!config.shared_upstream && config.upstream.kind == keyguard::config::Upstream::Kind::kCluster) {
      return FailToStart("--upstream-connections: a Redis Cluster upstream is always served with shared connections");
    }
  }
  if (config.read_from_replicas && config.upstream.kind != keyguard::config::Upstream::Kind::kCluster) {
    return FailToStart("cluster.read_from: is for a redis-cluster:// upstream");
  }
  // A Redis Cluster is always served with shared connections, one per primary per worker.
  if (config.upstream.kind == keyguard::config::Upstream::Kind::kCluster) config.shared_upstream = true;
  if (auto s = keyguard::config::Validate(config); !s.ok()) return FailToStart(std::string(s.message()));
  auto status = keyguard::proxy::RunServer(config, flags.Str("--config"));
  if (!status.ok()) return FailToStart(std::string(status.message()));
  return 0;
}
