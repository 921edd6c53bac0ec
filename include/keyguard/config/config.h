// The proxy's settings: parsed from YAML once, validated with field paths in every message, then
// kept as a plain immutable struct (the hot path never looks at YAML).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "keyguard/hygiene/detectors.h"
#include "keyguard/policy/key_policy.h"
#include "keyguard/resp/framer.h"
#include "keyguard/tenant/tenancy.h"

namespace keyguard::config {
namespace v1 {
class Config;
}

struct HostPort {
  std::string host;
  uint16_t port = 0;
  std::string ToString() const;
};

// Parses "HOST:PORT" or "[v6]:PORT"; `field` names the setting in error messages.
absl::StatusOr<HostPort> ParseHostPort(std::string_view text, std::string_view field);

struct ProxyConfig {
  HostPort listen{"127.0.0.1", 6380};
  HostPort upstream{"127.0.0.1", 6379};
  HostPort admin{"127.0.0.1", 9121};
  int threads = 0;  // worker threads; 0 = one per hardware thread
  int upstream_connect_timeout_ms = 2000;
  int drain_timeout_ms = 10000;            // after SIGTERM, how long in-flight replies may take
  std::vector<std::string> deny_commands;  // lowercase command names refused with an error
  resp::Limits limits;
  int64_t max_pending_commands = 10000;  // per connection: stop reading the client beyond this
  int64_t max_output_buffer = 1 << 20;   // per direction: stop reading the other side beyond this
  int64_t read_buffer_size = 16 * 1024;  // initial read buffer per direction
  hygiene::Settings hygiene;
  // Commands the table does not know: forwarded (and counted) or refused.
  bool reject_unknown_commands = false;
  // Key-name rules; without a config every built-in rule observes.
  std::shared_ptr<const policy::KeyPolicy> key_policy = policy::KeyPolicy::Default();
  // Tenant prefixes; nullptr when tenancy is off. Fixed at start-up.
  std::shared_ptr<const tenant::Tenancy> tenancy;
  // keyguard's own credentials for the upstream.
  tenant::UpstreamAuth upstream_auth;
};

// Parses a YAML document against the schema in proto/keyguard/config/v1/config.proto; unknown
// keys, wrong types and invalid values are errors naming the field path.
absl::StatusOr<ProxyConfig> ParseConfig(std::string_view yaml);
absl::StatusOr<ProxyConfig> LoadConfigFile(const std::string& path);
// Turns the schema message into settings, checking ranges and compiling the key policy.
absl::StatusOr<ProxyConfig> Compile(const v1::Config& proto);
// Checks cross-field constraints; returns the first problem with its field path.
absl::Status Validate(const ProxyConfig& config);

}  // namespace keyguard::config
