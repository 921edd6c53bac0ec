// The sizing probe: one background upstream connection per worker that asks the type, size and
// MEMORY USAGE of keys the detectors want to know about (ProbeQueue), rate-limited, off every
// client's path. What it learns goes into the worker's SizeCache; a big key becomes a
// big_key_access finding attributed to the command that touched it.
#pragma once

#include <deque>
#include <memory>
#include <string>

#include "keyguard/hygiene/sizes.h"
#include "proxy/asio.h"
#include "proxy/read_buffer.h"

namespace keyguard::proxy {

struct Worker;

class SizeProbe : public std::enable_shared_from_this<SizeProbe> {
 public:
  explicit SizeProbe(Worker& worker);
  void Start();
  // A request was queued: wake the loop if it sleeps.
  void Wake();
  // Closes the connection and ends the loop.
  void Stop();

 private:
  awaitable<void> Run();
  awaitable<bool> Connect();
  // Sends `commands` (encoded) and reads `n` replies into replies_ (frames as strings).
  awaitable<bool> RoundTrip(const std::string& commands, size_t n);
  void Learn(hygiene::ProbeRequest& r, std::string_view type, int64_t size, int64_t memory);

  Worker& worker_;
  Socket socket_;
  Timer timer_;
  ReadBuffer buf_{16 * 1024};
  std::deque<std::string> replies_;
  std::deque<hygiene::ProbeRequest> batch_;
  bool sleeping_ = false;
  bool stopped_ = false;
};

}  // namespace keyguard::proxy
