// Socket readiness without a system call per wait.
//
// Asio 1.74's reactor either retries a read speculatively before every wait (an EAGAIN recv per
// command at pipeline depth 1) or re-arms the descriptor with epoll_ctl on every async_wait. A
// Poller instead owns one epoll instance per worker in which each socket is registered once,
// edge-triggered, for input and output; the worker's io_context watches the epoll descriptor,
// and each harvest marks sockets ready and resumes the coroutines waiting on them. A command
// then costs one recv and one send per direction, like haproxy.
#pragma once

#include <memory>

#include "proxy/asio.h"

namespace keyguard::proxy {

// Readiness of one socket in one direction, awaited by at most one coroutine at a time.
// Starts ready: the first read or write is tried before any wait.
class Readiness {
 public:
  bool ready() const { return ready_; }
  // Records that the socket has been drained (a read came back short or with EAGAIN).
  void Clear() { ready_ = false; }
  // Marks ready and resumes the waiter (posted, never run inline).
  void Signal();
  // Resumes the waiter with operation_aborted; every later Wait completes with it at once.
  void Abort();
  // Completes when ready (at once if it is) or aborted.
  awaitable<error_code> Wait();

 private:
  struct WaiterBase {
    virtual ~WaiterBase() = default;
    virtual void Complete(error_code ec) = 0;
  };
  template <typename Handler>
  struct Waiter;

  bool ready_ = true;
  bool aborted_ = false;
  std::unique_ptr<WaiterBase> waiter_;
};

// The two directions of one socket; registered with the Poller by address.
struct SocketReadiness {
  Readiness in;
  Readiness out;
};

class Poller {
 public:
  explicit Poller(asio::io_context& io);

  // Registers `fd` (edge-triggered, in and out) until Remove(); `r` must outlive the registration.
  bool Add(int fd, SocketReadiness* r);
  void Remove(int fd);
  // Starts harvesting on the io_context.
  void Start();

 private:
  awaitable<void> Run();

  asio::posix::stream_descriptor watch_;  // owns the epoll descriptor
};

}  // namespace keyguard::proxy
