// One place to include Asio: GCC 12 + Boost 1.74 need <utility> before awaitable.hpp.
//
// Every socket, timer and coroutine runs on an io_context, so they name its executor type
// (Executor) instead of Asio's default, the type-erased any_io_executor: each completion,
// co_await and coroutine frame then skips any_executor's indirect calls and copies (at pipeline
// depth 1 that was about a fifth of the proxy's instructions per command).
#pragma once

#include <utility>

#include <boost/asio.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>

namespace keyguard {
namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

using Executor = asio::io_context::executor_type;
template <class T>
using awaitable = asio::awaitable<T, Executor>;
using Socket = asio::basic_stream_socket<tcp, Executor>;
using Acceptor = asio::basic_socket_acceptor<tcp, Executor>;
using Timer =
    asio::basic_waitable_timer<std::chrono::steady_clock, asio::wait_traits<std::chrono::steady_clock>, Executor>;

// The completion token for socket and timer calls in an awaitable<>: the error lands in `ec`.
inline auto AwaitEc(error_code& ec) { return asio::redirect_error(asio::use_awaitable_t<Executor>(), ec); }
}  // namespace keyguard
