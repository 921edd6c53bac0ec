#include "proxy/connection_state.h"

#include "keyguard/commands/traits.h"
#include "keyguard/resp/framer.h"
#include "keyguard/tenant/rewrite.h"

namespace keyguard::proxy {
namespace {

using commands::EqualsIgnoreCase;
using Kind = Pending::Kind;

}  // namespace

int ConfirmIndex(std::string_view kind) {
  for (int i = 0; i < 6; ++i) {
    if (EqualsIgnoreCase(kind, kConfirmNames[i])) return i;
  }
  return -1;
}

int8_t HelloVersion(std::span<const std::string_view> args) {
  int64_t v = 0;
  if (args.size() > 1 && resp::ParseRedisInt(args[1], &v) && (v == 2 || v == 3)) return static_cast<int8_t>(v);
  return 0;
}

bool QueuedAsIs(commands::CommandId id, std::span<const std::string_view> args) {
  static const uint32_t kNoMulti = commands::CommandFlagMask("no_multi");
  const commands::KnownCommands& k = commands::Known();
  if (id == k.debug || id == k.module) return false;
  const commands::CommandSpec* spec = commands::ResolveSpec(id, args);
  // ResolveSpec is the subcommand's spec for a container command (containers carry no flags of
  // their own), else the command's.
  return spec != nullptr && (spec->flags & kNoMulti) == 0 && ArityAllows(spec->arity, args.size());
}

ConnectionState::Effects ConnectionState::OnStateCommand(commands::CommandId id, std::span<const std::string_view> args,
                                                         ReplyMode mode, bool tenant, Pending* p, Effects e) {
  using enum commands::ConnectionRole;
  const commands::ConnectionRole role = commands::TraitsOf(id).connection;
  if (role == kQuit) {
    e.stop_reading = true;  // Redis reads nothing after QUIT (also inside MULTI: QUIT is not queued)
    quit_sent_ = true;
  } else if (!ArityOk(id, args.size())) {
    // The server answers with an arity error and changes no state (inside MULTI the command is
    // not queued, and EXEC will abort): `MULTI x` starts no transaction. A refused EXEC is the
    // exception: the server answers -EXECABORT and discards the transaction (execCommandAbort).
    if (role == kExec) EndTransaction();
  } else if (role == kReset) {
    // RESET is not queued by MULTI either: it discards the transaction and every mode.
    p->kind = Kind::kReset;
    if (mode.skipped) {
      // Redis would skip RESET's reply, which tells keyguard the server has reset: a PING takes
      // the skip, and the +RESET is read but not shown.
      e.ping_first = true;
      p->hidden = true;
    }
    reply_off_ = false;
    e.silent = false;
    EndTransaction();
    // RESET logs the connection out: the client must authenticate again.
    e.logout = true;
  } else if (role == kMulti) {
    // A nested MULTI is an error that keeps the transaction: what was queued stays queued.
    if (!in_multi_) {
      multi_rewrites_.clear();
      queued_ = 0;
      p->expect = Pending::Expect::kMultiOk;
    }
    in_multi_ = true;
  } else if (role == kWatch) {
    if (in_multi_) {
      // Redis refuses WATCH inside MULTI without queueing it; the transaction goes on.
    } else {
      watching_ = true;
    }
  } else if (role == kUnwatch && !in_multi_) {
    watching_ = false;
  } else if (role == kExec) {
    p->expect = in_multi_ ? Pending::Expect::kExecInMulti : Pending::Expect::kExecOutside;
    if (in_multi_ && multi_aborted_) {
      p->kind = Kind::kExecAbort;
      e.send_discard = true;
    }
    if ((tenant || own_queued_) && in_multi_) {
      // Every EXEC of a tenant is checked element by element, also when no queued command needed
      // a rewrite: its reply must hold exactly the commands keyguard saw queued, or none passes.
      p->rewrite = static_cast<uint8_t>(tenant::ReplyRewrite::kExec);
      p->exec_rewrites = std::move(multi_rewrites_);
    }
    // Outside a transaction EXEC and DISCARD are errors that change nothing: the WATCH stays.
    if (in_multi_) EndTransaction();
  } else if (role == kDiscard) {
    if (in_multi_) EndTransaction();
  } else if (in_multi_) {
    // Queued like any command: UNWATCH, HELLO, MONITOR, CLIENT, SYNC, the subscribe family.
    Queued(tenant, p);
  } else if (role == kSubscribe || role == kUnsubscribe) {
    const bool unsub = role == kUnsubscribe;
    if (args.size() > 1 || unsub) {
      p->kind = Kind::kSubscribe;
      p->confirm = static_cast<uint8_t>(ConfirmIndex(args[0]));
      p->expected = args.size() > 1 ? static_cast<int64_t>(args.size() - 1) : -1;
    }
  } else if (role == kHello) {
    p->kind = Kind::kHello;
    p->hello_version = HelloVersion(args);
  } else if (role == kMonitor) {
    p->kind = Kind::kMonitor;
  } else if (role == kSync && !e.silent) {
    // The server answers with newline keep-alives, then $<len>\r\n<RDB> without a CRLF (or a
    // diskless EOF-marked payload), then commands that answer no request, for the connection's
    // life: no reply framing fits, so from this reply on the upstream side is a byte tunnel.
    p->kind = Kind::kReplicationStream;
    replication_stream_ = true;
  } else if (role == kClient && args.size() == 3 && EqualsIgnoreCase(args[1], "setname")) {
    client_name_.assign(args[2].data(), args[2].size());
  } else if (role == kClient && args.size() == 3 && EqualsIgnoreCase(args[1], "reply")) {
    if (EqualsIgnoreCase(args[2], "off")) {
      reply_off_ = true;
      e.silent = true;
    } else if (EqualsIgnoreCase(args[2], "skip")) {
      e.silent = true;
      skip_next_reply_ = !reply_off_;
    } else if (EqualsIgnoreCase(args[2], "on")) {
      reply_off_ = false;
      e.silent = false;
    }
  }
  return e;
}

bool ConnectionState::OnModeReply(const Pending& p) {
  switch (p.kind) {
    case Kind::kHello:
      if (p.hello_version != 0) protocol_ = p.hello_version;
      return false;
    case Kind::kMonitor: monitor_ = true; return false;
    case Kind::kReset:
      protocol_ = 2;
      monitor_ = false;
      for (auto& s : subscriptions_) s.clear();
      return true;
    default: return false;
  }
}

bool IsMonitorLine(std::string_view line) {
  if (line.empty() || line[0] < '0' || line[0] > '9') return false;
  const size_t sp = line.find(' ');
  return sp != std::string_view::npos && sp + 1 < line.size() && line[sp + 1] == '[' &&
         line.substr(0, sp).find('.') != std::string_view::npos;
}

FrameRole ConnectionState::ClassifyOther(const Pending* front, char type,
                                         std::span<const resp::ReplyFramer::Scalar> head, bool filtered) const {
  const std::string_view kind = head.empty() ? std::string_view() : head[0].text;
  // Subscribe confirmations: pushes in RESP3, arrays in RESP2.
  if ((type == '>' || (type == '*' && protocol_ == 2)) && front != nullptr && head.size() >= 2 &&
      IsConfirmationFor(*front, kind)) {
    return FrameRole::kConfirmation;
  }
  if (type == '>') return FrameRole::kPush;
  if (type == '*' && protocol_ == 2 && head.size() >= 2 && subscribed() &&
      (EqualsIgnoreCase(kind, "message") || EqualsIgnoreCase(kind, "pmessage") || EqualsIgnoreCase(kind, "smessage"))) {
    return FrameRole::kPush;
  }
  if (monitor_ && type == '+' && IsMonitorLine(kind)) return FrameRole::kPush;
  if (front == nullptr) return FrameRole::kUnexpected;
  if (front->kind == Kind::kInternal) return FrameRole::kInternal;
  if (filtered && front->expect != Pending::Expect::kAny && !AsExpected(front->expect, type, kind)) {
    return FrameRole::kDesync;
  }
  if (front->kind == Kind::kWalk) return FrameRole::kWalkStep;
  return FrameRole::kReply;
}

bool ConnectionState::IsConfirmationFor(const Pending& p, std::string_view kind) const {
  return p.kind == Kind::kSubscribe && EqualsIgnoreCase(kind, kConfirmNames[p.confirm]);
}

void ConnectionState::TrackConfirmation(std::string_view kind, std::string_view channel) {
  const int i = ConfirmIndex(kind);
  if (i < 0) return;
  auto& set = subscriptions_[i / 2];
  if (i % 2 == 0) {
    set.emplace(channel);
  } else {
    set.erase(std::string(channel));
  }
}

}  // namespace keyguard::proxy
