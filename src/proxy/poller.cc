#include "proxy/poller.h"

#include <sys/epoll.h>
#include <unistd.h>

namespace keyguard::proxy {

template <typename Handler>
struct Readiness::Waiter : Readiness::WaiterBase {
  explicit Waiter(Handler h) : handler(std::move(h)) {}
  void Complete(error_code ec) override {
    auto executor = asio::get_associated_executor(handler);
    asio::post(executor, [h = std::move(handler), ec]() mutable { std::move(h)(ec); });
  }
  Handler handler;
};

void Readiness::Signal() {
  ready_ = true;
  if (waiter_) {
    std::unique_ptr<WaiterBase> w = std::move(waiter_);
    w->Complete(error_code());
  }
}

void Readiness::Abort() {
  aborted_ = true;
  if (waiter_) {
    std::unique_ptr<WaiterBase> w = std::move(waiter_);
    w->Complete(asio::error::operation_aborted);
  }
}

awaitable<error_code> Readiness::Wait() {
  if (aborted_) co_return asio::error::operation_aborted;
  if (ready_) co_return error_code();
  error_code ec;
  auto token = AwaitEc(ec);
  co_await asio::async_initiate<decltype(token), void(error_code)>(
      [this](auto handler) { waiter_ = std::make_unique<Waiter<decltype(handler)>>(std::move(handler)); }, token);
  co_return ec;
}

Poller::Poller(asio::io_context& io) : watch_(io, ::epoll_create1(EPOLL_CLOEXEC)) {}

bool Poller::Add(int fd, SocketReadiness* r) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
  ev.data.ptr = r;
  return ::epoll_ctl(watch_.native_handle(), EPOLL_CTL_ADD, fd, &ev) == 0;
}

void Poller::Remove(int fd) {
  epoll_event ev{};
  ::epoll_ctl(watch_.native_handle(), EPOLL_CTL_DEL, fd, &ev);
}

void Poller::Start() { asio::co_spawn(watch_.get_executor(), Run(), asio::detached); }

awaitable<void> Poller::Run() {
  constexpr int kBatch = 256;
  epoll_event events[kBatch];
  for (;;) {
    error_code ec;
    co_await watch_.async_wait(asio::posix::descriptor_base::wait_read, AwaitEc(ec));
    if (ec) co_return;
    int n;
    do {
      n = ::epoll_wait(watch_.native_handle(), events, kBatch, 0);
      for (int i = 0; i < n; ++i) {
        auto* r = static_cast<SocketReadiness*>(events[i].data.ptr);
        const uint32_t e = events[i].events;
        if (e & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) r->in.Signal();
        if (e & (EPOLLOUT | EPOLLHUP | EPOLLERR)) r->out.Signal();
      }
    } while (n == kBatch);
  }
}

}  // namespace keyguard::proxy
