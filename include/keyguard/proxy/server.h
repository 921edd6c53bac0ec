// The running proxy: worker threads (one io_context and one SO_REUSEPORT acceptor each), the
// admin HTTP server on its own thread, and graceful drain on SIGTERM/SIGINT.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "keyguard/config/config.h"

namespace keyguard::proxy {

// Runs until SIGTERM/SIGINT, then stops accepting, lets pending replies finish within
// config.drain_timeout_ms, and returns OK. Returns an error if it cannot start (bind, resolve).
// SIGHUP, or a change of the file at `config_path` (checked every second), reloads the key
// policy, deny list and unknown_commands from it.
absl::Status RunServer(const config::ProxyConfig& config, const std::string& config_path);

}  // namespace keyguard::proxy
