// The sizing probe: background upstream connections per worker (one to the upstream, or one per
// cluster node it asks about) that ask the type, size and MEMORY USAGE of keys the detectors want
// to know about (ProbeQueue), rate-limited, off every client's path. What it learns goes into the
// worker's SizeCache; a big key becomes a big_key_access finding attributed to the command that
// touched it. Its connections are made as the clients' are (TLS, keyguard's AUTH).
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "keyguard/hygiene/sizes.h"
#include "proxy/asio.h"
#include "proxy/read_buffer.h"
#include "proxy/shared_upstream.h"
#include "proxy/stream.h"

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
  // A connection of the probe's, to the upstream or to one cluster node.
  struct Conn {
    explicit Conn(asio::io_context& io) : stream(io) {}
    Stream stream;
    ReadBuffer buf{16 * 1024};
  };
  awaitable<void> Run();
  // The connection to `key` ("": the upstream; "host:port": the cluster node `to`), connected
  // (ConnectUpstream) if it was not; nullptr when it cannot be.
  awaitable<Conn*> ConnFor(const std::string& key, const UpstreamAddress* to);
  // Asks the connection about the requests `which` of batch_ (their indices), in two rounds.
  // False when the connection failed (it is dropped).
  awaitable<bool> Ask(Conn& c, const std::vector<size_t>& which);
  // Sends `commands` (encoded) and reads `n` replies into replies_ (frames as strings).
  awaitable<bool> RoundTrip(Conn& c, const std::string& commands, size_t n);
  void Learn(hygiene::ProbeRequest& r, std::string_view type, int64_t size, int64_t memory);
  // A cluster: closes the connections to nodes that are no longer primaries of the map (a node
  // removed, or emptied of slots), each time round the loop (at least once a second).
  void DropDepartedNodes();

  Worker& worker_;
  std::unordered_map<std::string, std::unique_ptr<Conn>> conns_;
  Timer timer_;
  std::deque<std::string> replies_;
  std::deque<hygiene::ProbeRequest> batch_;
  bool sleeping_ = false;
  bool stopped_ = false;
};

}  // namespace keyguard::proxy
