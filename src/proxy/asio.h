// One place to include Asio: GCC 12 + Boost 1.74 need <utility> before awaitable.hpp.
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
using asio::awaitable;
using asio::ip::tcp;
using boost::system::error_code;
inline auto AwaitEc(error_code& ec) { return asio::redirect_error(asio::use_awaitable, ec); }
}  // namespace keyguard
