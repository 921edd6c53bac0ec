// The running proxy: worker threads (one io_context and one SO_REUSEPORT acceptor each), the
// admin HTTP server on its own thread, and graceful drain on SIGTERM/SIGINT.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "keyguard/config/config.h"

namespace keyguard::proxy {

// Runs until SIGTERM/SIGINT, then stops accepting, lets pending replies finish within
// config.drain_timeout_ms, and returns OK. Returns an error if it cannot start (bind, resolve).
absl::Status RunServer(const config::ProxyConfig& config);

}  // namespace keyguard::proxy
