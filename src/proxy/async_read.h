// AsyncReadSome(socket, buffer, token): Socket::async_read_some without the EAGAIN recv()
// that Asio's epoll reactor makes before it waits for a socket that is known to be empty.
//
// Asio 1.74 registers each socket with epoll edge-triggered. When a read is started with none
// queued, the reactor first tries recv() at once ("speculatively") unless its per-socket flag says
// the socket is exhausted; only an edge that finds no read queued sets the flag again
// (epoll_reactor::descriptor_state::perform_io). Asio's own recv op reports "exhausted" only for
// a read of 0 bytes, so at pipeline depth 1 each read after a reply is an EAGAIN recv(): one per
// direction per command.
//
// This read reports a read that returns fewer bytes than the buffer had room for as exhausted, as
// Asio's send op does for a short write. That is exact for TCP: a recv() returns short only when
// it has emptied the socket's receive queue, so every byte it did not return arrives later and
// raises a new edge: either the queued read is performed then, or, if no read is queued yet, the
// edge sets the flag and the next read tries recv() first. A read that fills the buffer (a backlog
// larger than it, a multi-MB value) leaves the flag set, so the next read tries recv() first, as
// before; nothing is ever waited for that is already there. Two exceptions: TCP urgent data
// (MSG_OOB), which no Redis client or server sends: recv() stops short at the urgent mark, and the
// bytes after it are read with the next bytes that arrive; and a FIN that arrived with the last
// bytes: the short read leaves it queued and no edge follows, so the end of the stream would be
// seen only with the next write. For the upstream, where replies are waited for, a worker looks
// each second (Session::CheckUpstream, SharedLink::CheckLiveness: a peek on a connection that owes
// replies and has been silent for a second) and cancels the read of one the server closed.
//
// Waiting with async_wait(wait_read) and then reading would not save the call: Asio's async_wait
// re-arms the socket with epoll_ctl(EPOLL_CTL_MOD) every time (which also makes it safe with edge
// triggering: the re-arm reports data already there), so it trades the EAGAIN recv() for an
// epoll_ctl().
//
// The op is built from Asio 1.74's internals (reactive_socket_recv_op with its perform step
// changed); any other Boost version, or a build without epoll, uses async_read_some unchanged.
#pragma once

#include <type_traits>

#include "proxy/asio.h"

#if BOOST_VERSION == 107400 && defined(BOOST_ASIO_HAS_EPOLL) && !defined(BOOST_ASIO_HAS_IOCP)
#define KEYGUARD_SHORT_READ_EXHAUSTS 1
#include <boost/asio/detail/bind_handler.hpp>
#include <boost/asio/detail/fenced_block.hpp>
#include <boost/asio/detail/handler_alloc_helpers.hpp>
#include <boost/asio/detail/handler_cont_helpers.hpp>
#include <boost/asio/detail/handler_work.hpp>
#include <boost/asio/detail/reactive_socket_service.hpp>
#include <boost/asio/detail/reactor_op.hpp>
#include <boost/asio/detail/socket_ops.hpp>
#else
#define KEYGUARD_SHORT_READ_EXHAUSTS 0
#endif

namespace keyguard::proxy {

#if KEYGUARD_SHORT_READ_EXHAUSTS
namespace read_internals {

namespace detail = asio::detail;
using Service = detail::reactive_socket_service<tcp>;

// Pointers to the protected members that async_read_some itself uses: the socket's service and
// implementation, and the service's start_op (which hands the op to the reactor).
struct SocketAccess : Socket {
  static constexpr auto kImpl = &SocketAccess::impl_;
};
struct ServiceAccess : detail::reactive_socket_service_base {
  static constexpr auto kStartOp = &ServiceAccess::start_op;
};

// Asio's reactive_socket_recv_op for one buffer and no flags; only the status differs.
template <typename Handler, typename IoExecutor>
class ReadOp : public detail::reactor_op {
 public:
  BOOST_ASIO_DEFINE_HANDLER_PTR(ReadOp);

  ReadOp(const error_code& success_ec, detail::socket_type socket, asio::mutable_buffer buffer, Handler& handler,
         const IoExecutor& io_ex)
      : reactor_op(success_ec, &ReadOp::DoPerform, &ReadOp::DoComplete),
        socket_(socket),
        buffer_(buffer),
        handler_(std::move(handler)),
        work_(handler_, io_ex) {}

  static status DoPerform(reactor_op* base) {
    auto* o = static_cast<ReadOp*>(base);
    if (!detail::socket_ops::non_blocking_recv1(o->socket_, o->buffer_.data(), o->buffer_.size(), 0,
                                                /*is_stream=*/true, o->ec_, o->bytes_transferred_)) {
      return not_done;  // EAGAIN: wait for the edge
    }
    // Short (end of stream and errors included: 0 bytes): the receive queue is empty.
    return o->bytes_transferred_ < o->buffer_.size() ? done_and_exhausted : done;
  }

  static void DoComplete(void* owner, detail::operation* base, const error_code& /*ec*/, std::size_t /*bytes*/) {
    auto* o = static_cast<ReadOp*>(base);
    ptr p = {detail::addressof(o->handler_), o, o};
    detail::handler_work<Handler, IoExecutor> w(std::move(o->work_));
    // Copy the handler out so the op's memory is freed before the upcall (as Asio's ops do).
    detail::binder2<Handler, error_code, std::size_t> handler(o->handler_, o->ec_, o->bytes_transferred_);
    p.h = detail::addressof(handler.handler_);
    p.reset();
    if (owner) {
      detail::fenced_block b(detail::fenced_block::half);
      w.complete(handler, handler.handler_);
    }
  }

 private:
  detail::socket_type socket_;
  asio::mutable_buffer buffer_;
  Handler handler_;
  detail::handler_work<Handler, IoExecutor> work_;
};

struct InitiateRead {
  Socket* socket;

  template <typename Handler>
  void operator()(Handler&& handler, asio::mutable_buffer buffer) const {
    using H = std::decay_t<Handler>;
    auto& io = (*socket).*SocketAccess::kImpl;
    Service& service = io.get_service();
    Service::implementation_type& impl = io.get_implementation();
    using Op = ReadOp<H, std::decay_t<decltype(io.get_executor())>>;
    H h(std::forward<Handler>(handler));
    const bool is_continuation = boost_asio_handler_cont_helpers::is_continuation(h);
    typename Op::ptr p = {detail::addressof(h), Op::ptr::allocate(h), 0};
    p.p = new (p.v) Op(error_code(), impl.socket_, buffer, h, io.get_executor());
    // As async_read_some: a read op, tried at once unless the reactor knows the socket is empty.
    (service.*ServiceAccess::kStartOp)(impl, detail::epoll_reactor::read_op, p.p, is_continuation,
                                       /*is_non_blocking=*/true, /*noop=*/buffer.size() == 0);
    p.v = p.p = 0;
  }
};

}  // namespace read_internals
#endif

// Reads at least one byte into `buffer` (which must not be empty), completing with
// (error_code, bytes read) as socket.async_read_some does. `socket` must outlive the read.
template <typename Token>
auto AsyncReadSome(Socket& socket, asio::mutable_buffer buffer, Token&& token) {
#if KEYGUARD_SHORT_READ_EXHAUSTS
  return asio::async_initiate<Token, void(error_code, std::size_t)>(read_internals::InitiateRead{&socket}, token,
                                                                    buffer);
#else
  return socket.async_read_some(buffer, std::forward<Token>(token));
#endif
}

}  // namespace keyguard::proxy
