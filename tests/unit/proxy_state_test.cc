// The proxy's sans-io core without sockets: ConnectionState (what a command and its reply do to
// the connection, as Redis 7.0 does it) and ReplyQueue (order, keyguard's own replies, abort,
// the key arena). Each case is a script of commands and replies with the state expected after.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "keyguard/tenant/rewrite.h"
#include "proxy/connection_state.h"
#include "proxy/reply_queue.h"
#include "proxy/scratch.h"

namespace keyguard::proxy {
namespace {

using Kind = Pending::Kind;
using Expect = Pending::Expect;

// One command through the state as the session sends it: its reply mode, then OnForward.
struct Sent {
  ConnectionState::ReplyMode mode;
  ConnectionState::Effects effects;
  Pending p;
};

Sent Send(ConnectionState& s, const std::string& line, bool tenant = false, uint8_t rewrite = 0) {
  std::vector<std::string> words = absl::StrSplit(line, ' ');
  std::vector<std::string_view> args(words.begin(), words.end());
  Sent out;
  out.mode = s.TakeReplyMode();
  out.p.command = commands::LookupCommand(args[0]);
  out.p.rewrite = rewrite;
  // As the session keeps them: the views must outlive the call only.
  out.effects = s.OnForward(out.p.command, args, out.mode, tenant, &out.p);
  return out;
}

TEST(ConnectionStateTest, PlainCommandsChangeNothing) {
  ConnectionState s;
  Sent x = Send(s, "GET k");
  EXPECT_EQ(x.p.kind, Kind::kForward);
  EXPECT_EQ(x.p.expect, Expect::kAny);
  EXPECT_FALSE(x.effects.silent || x.effects.stop_reading || x.effects.ping_first || x.effects.send_discard);
  EXPECT_FALSE(s.in_multi());
  EXPECT_EQ(s.protocol(), 2);
  EXPECT_EQ(Send(s, "GET k", /*tenant=*/true).p.expect, Expect::kNotQueued);
}

TEST(ConnectionStateTest, TransactionQueuesAndExecCarriesTheTenantRewrites) {
  ConnectionState s;
  Sent multi = Send(s, "MULTI", true);
  EXPECT_EQ(multi.p.expect, Expect::kMultiOk);
  EXPECT_TRUE(s.in_multi());
  Sent get = Send(s, "GET k", true, /*rewrite=*/5);
  EXPECT_EQ(get.p.expect, Expect::kQueued);
  EXPECT_EQ(get.p.rewrite, 0);              // the reply is +QUEUED; the rewrite applies inside EXEC's reply
  Sent unwatch = Send(s, "UNWATCH", true);  // queued like any command inside MULTI
  EXPECT_EQ(unwatch.p.expect, Expect::kQueued);
  Sent nested = Send(s, "MULTI", true);  // an error that keeps the transaction
  EXPECT_EQ(nested.p.expect, Expect::kNotQueued);
  EXPECT_TRUE(s.in_multi());
  Sent exec = Send(s, "EXEC", true);
  EXPECT_EQ(exec.p.kind, Kind::kForward);
  EXPECT_EQ(exec.p.expect, Expect::kExecInMulti);
  EXPECT_EQ(exec.p.rewrite, static_cast<uint8_t>(tenant::ReplyRewrite::kExec));
  EXPECT_EQ(exec.p.exec_rewrites, (std::vector<uint8_t>{5, 0}));
  EXPECT_FALSE(s.in_multi());
  EXPECT_EQ(Send(s, "EXEC", true).p.expect, Expect::kExecOutside);
}

TEST(ConnectionStateTest, KeyguardsOwnCommandInsideMultiLeavesExecsReply) {
  constexpr auto kOwn = static_cast<uint8_t>(tenant::ReplyRewrite::kOwn);
  ConnectionState s;
  Pending outside;
  s.OnOwn(false, &outside);  // outside MULTI: an internal command, nothing recorded
  EXPECT_EQ(outside.kind, Kind::kInternal);
  EXPECT_EQ(outside.expect, Expect::kAny);
  EXPECT_EQ(Send(s, "EXEC").p.rewrite, 0);
  Send(s, "MULTI");
  Send(s, "SET a 1");
  Pending own;
  s.OnOwn(false, &own);  // the move before the next queued command
  EXPECT_EQ(own.kind, Kind::kInternal);
  EXPECT_EQ(own.expect, Expect::kQueued);
  Send(s, "GET b");
  Sent exec = Send(s, "EXEC");
  // Without a tenant too, EXEC's reply loses the element of keyguard's own command.
  EXPECT_EQ(exec.p.rewrite, static_cast<uint8_t>(tenant::ReplyRewrite::kExec));
  EXPECT_EQ(exec.p.exec_rewrites, (std::vector<uint8_t>{0, kOwn, 0}));
  std::string out;
  EXPECT_EQ(tenant::DropOwnElements(exec.p.exec_rewrites, "*3\r\n+OK\r\n:1\r\n$1\r\nx\r\n", &out),
            tenant::ReplyAction::kReplace);
  EXPECT_EQ(out, "*2\r\n+OK\r\n$1\r\nx\r\n");
  // An aborted transaction's error, or a count that is not the queued one, passes as it is.
  EXPECT_EQ(tenant::DropOwnElements(exec.p.exec_rewrites, "-EXECABORT Transaction discarded\r\n", &out),
            tenant::ReplyAction::kPass);
  EXPECT_EQ(tenant::DropOwnElements(exec.p.exec_rewrites, "*-1\r\n", &out), tenant::ReplyAction::kPass);
  // What the moves did: the keys they moved, and their errors (counted as outside MULTI).
  tenant::OwnResults own_results = tenant::OwnElementResults(exec.p.exec_rewrites, "*3\r\n+OK\r\n:2\r\n$1\r\nx\r\n");
  EXPECT_EQ(own_results.moved, 2);
  EXPECT_EQ(own_results.errors, 0);
  own_results = tenant::OwnElementResults(exec.p.exec_rewrites, "*3\r\n+OK\r\n-ERR no\r\n:7\r\n");
  EXPECT_EQ(own_results.moved, 0);
  EXPECT_EQ(own_results.errors, 1);
  own_results = tenant::OwnElementResults(exec.p.exec_rewrites, "*-1\r\n");
  EXPECT_EQ(own_results.moved + own_results.errors, 0);
  // The next transaction starts clean.
  Send(s, "MULTI");
  Send(s, "GET b");
  EXPECT_EQ(Send(s, "EXEC").p.rewrite, 0);
}

TEST(ReplyQueueTest, RenamedKeysGoBackToTheClientsNamesInTheReplysShape) {
  const std::vector<std::pair<std::string, std::string>> names = {{"user:5:profile", "User_5_Profile"}};
  std::string out;
  using tenant::ReplyAction;
  using tenant::ReplyRewrite;
  EXPECT_EQ(tenant::RenameKeys(ReplyRewrite::kFirstKey, names, "*2\r\n$14\r\nuser:5:profile\r\n$1\r\na\r\n", &out),
            ReplyAction::kReplace);
  EXPECT_EQ(out, "*2\r\n$14\r\nUser_5_Profile\r\n$1\r\na\r\n");
  EXPECT_EQ(tenant::RenameKeys(ReplyRewrite::kFirstKey, names, "*2\r\n$5\r\nother\r\n$1\r\na\r\n", &out),
            ReplyAction::kPass);
  EXPECT_EQ(tenant::RenameKeys(ReplyRewrite::kFirstKey, names, "*-1\r\n", &out), ReplyAction::kPass);
  // An error that quotes the new name quotes the client's; an unquoted mention stays.
  EXPECT_EQ(tenant::RenameKeys(ReplyRewrite::kNone, names,
                               "-NOGROUP No such key 'user:5:profile' or consumer group 'user:5:profile'\r\n", &out),
            ReplyAction::kReplace);
  EXPECT_EQ(out, "-NOGROUP No such key 'User_5_Profile' or consumer group 'User_5_Profile'\r\n");
  EXPECT_EQ(tenant::RenameKeys(ReplyRewrite::kNone, names, "-ERR user:5:profile\r\n", &out), ReplyAction::kPass);
  EXPECT_EQ(tenant::RenameKeys(ReplyRewrite::kNone, names, "*1\r\n$14\r\nuser:5:profile\r\n", &out),
            ReplyAction::kPass);
  EXPECT_EQ(tenant::RenameKeys(ReplyRewrite::kStreams, names, "%1\r\n$14\r\nuser:5:profile\r\n*0\r\n", &out),
            ReplyAction::kReplace);
  EXPECT_EQ(out, "%1\r\n$14\r\nUser_5_Profile\r\n*0\r\n");
  // The queue keeps each entry's renames in order and drops them with it.
  ReplyQueue q;
  Pending a, b;
  const std::pair<std::string_view, std::string_view> views[] = {{names[0].first, names[0].second}};
  q.StageRenames(1, views);
  a.renamed = true;
  q.Push(std::move(a));
  q.Push(std::move(b));
  ASSERT_TRUE(q.front().renamed);
  EXPECT_EQ(q.HeadRenames().names, names);
  q.Pop();
  EXPECT_FALSE(q.front().renamed);
  q.Pop();
  EXPECT_TRUE(q.empty());
}

TEST(ReplyQueueTest, AStagedEntryIsResetInItsSlotAndQueuedOnlyWhenCommitted) {
  ReplyQueue q;
  Pending& a = q.Stage();
  a.command = commands::LookupCommand("get");
  a.exec_rewrites = {1, 2};
  a.hidden = true;
  EXPECT_TRUE(q.empty());  // not committed: nothing is queued
  Pending& b = q.Stage();  // the same slot, back to a new entry's values
  EXPECT_EQ(&a, &b);
  EXPECT_EQ(b.command, commands::kUnknownCommand);
  EXPECT_TRUE(b.exec_rewrites.empty());
  EXPECT_FALSE(b.hidden);
  EXPECT_EQ(b.kind, Kind::kForward);
  EXPECT_EQ(b.expected, 1);
  b.command = commands::LookupCommand("set");
  q.Commit();
  ASSERT_EQ(q.size(), 1u);
  EXPECT_EQ(q.front().command, commands::LookupCommand("set"));
  for (int i = 0; i < 40; ++i) {  // grows past the first ring while staged
    q.Stage().start_ns = i;
    q.Commit();
  }
  EXPECT_EQ(q.size(), 41u);
  q.Pop();
  EXPECT_EQ(q.front().start_ns, 0);
}

TEST(ConnectionStateTest, ARefusalInsideMultiTurnsExecIntoDiscard) {
  ConnectionState s;
  Send(s, "MULTI");
  s.OnRefused();  // keyguard answered a queued command itself
  Sent exec = Send(s, "EXEC");
  EXPECT_EQ(exec.p.kind, Kind::kExecAbort);
  EXPECT_TRUE(exec.effects.send_discard);
  EXPECT_FALSE(s.in_multi());
  // Outside MULTI a refusal changes nothing.
  s.OnRefused();
  Send(s, "MULTI");
  EXPECT_EQ(Send(s, "EXEC").p.kind, Kind::kForward);
}

TEST(ConnectionStateTest, WrongArityChangesNoStateButExecAbortsTheTransaction) {
  ConnectionState s;
  Sent bad = Send(s, "MULTI x", true);  // Redis: wrong number of arguments, no transaction
  EXPECT_FALSE(s.in_multi());
  EXPECT_EQ(bad.p.expect, Expect::kNotQueued);
  Send(s, "MULTI");
  Send(s, "EXEC x");  // the server answers EXECABORT and discards
  EXPECT_FALSE(s.in_multi());
  EXPECT_EQ(Send(s, "HELLO").p.kind, Kind::kHello);
  Sent sub = Send(s, "SUBSCRIBE");  // arity -2: an error, not a subscription
  EXPECT_EQ(sub.p.kind, Kind::kForward);
}

bool Queued(const std::string& line) {
  std::vector<std::string> words = absl::StrSplit(line, ' ');
  std::vector<std::string_view> args(words.begin(), words.end());
  return QueuedAsIs(commands::LookupCommand(args[0]), args);
}

TEST(ConnectionStateTest, QueuedAsIsKnowsWhatTheServerRefusesAsItQueues) {
  EXPECT_TRUE(Queued("PING"));
  EXPECT_TRUE(Queued("config get maxmemory"));
  EXPECT_TRUE(Queued("CONFIG GET maxmemory"));
  EXPECT_TRUE(Queued("OBJECT HELP"));
  EXPECT_FALSE(Queued("CONFIG NOSUCH"));    // unknown subcommand
  EXPECT_FALSE(Queued("CONFIG GET"));       // config|get's count
  EXPECT_FALSE(Queued("OBJECT ENCODING"));  // object|encoding's count
  EXPECT_FALSE(Queued("SAVE"));             // no_multi
  EXPECT_FALSE(Queued("SHUTDOWN"));         // no_multi
  EXPECT_FALSE(Queued("DEBUG SLEEP 0"));    // refused unless enable-debug-command
  EXPECT_FALSE(Queued("MODULE LIST"));      // refused unless enable-module-command
  EXPECT_FALSE(Queued("CLIENT KILL"));      // client|kill's count (at least 3)
  // QueuedAsIs reads a container's subcommand spec alone: no container carries no_multi itself.
  const uint32_t no_multi = commands::CommandFlagMask("no_multi");
  ASSERT_NE(no_multi, 0u);
  for (const commands::CommandSpec& spec : commands::AllSpecs()) {
    if (spec.sub_count > 0) EXPECT_EQ(spec.flags & no_multi, 0u) << spec.name;
  }
}

TEST(ConnectionStateTest, WatchFollowsTheServer) {
  ConnectionState s;
  Send(s, "WATCH a b");
  EXPECT_TRUE(s.watching());
  Send(s, "UNWATCH");
  EXPECT_FALSE(s.watching());
  Send(s, "WATCH a");
  Send(s, "MULTI");
  Send(s, "UNWATCH");  // queued: still watching until EXEC
  EXPECT_TRUE(s.watching());
  Send(s, "EXEC");
  EXPECT_FALSE(s.watching());
  Send(s, "MULTI");
  Send(s, "WATCH a");  // refused by Redis inside MULTI: no watch starts
  Send(s, "DISCARD");
  EXPECT_FALSE(s.watching());
  // EXEC and DISCARD without MULTI are errors that leave the WATCH (a shared connection's pin
  // must not end with it).
  Send(s, "WATCH a");
  Send(s, "EXEC");
  EXPECT_TRUE(s.watching());
  Send(s, "DISCARD");
  EXPECT_TRUE(s.watching());
  Send(s, "UNWATCH");
  EXPECT_FALSE(s.watching());
}

TEST(ConnectionStateTest, ClientReplyOffSkipOn) {
  ConnectionState s;
  Sent off = Send(s, "CLIENT REPLY OFF");
  EXPECT_TRUE(off.effects.silent);
  EXPECT_TRUE(Send(s, "GET k").mode.silent);
  Sent on = Send(s, "CLIENT REPLY ON");
  EXPECT_TRUE(on.mode.silent);
  EXPECT_FALSE(on.effects.silent);  // ON's own +OK is sent
  Sent skip = Send(s, "CLIENT REPLY SKIP");
  EXPECT_TRUE(skip.effects.silent);
  Sent skipped = Send(s, "GET k");
  EXPECT_TRUE(skipped.mode.skipped && skipped.mode.silent);
  EXPECT_FALSE(Send(s, "GET k").mode.silent);  // one command only
  // SKIP under OFF skips nothing more.
  Send(s, "CLIENT REPLY OFF");
  Send(s, "CLIENT REPLY SKIP");
  EXPECT_FALSE(Send(s, "GET k").mode.skipped);
}

TEST(ConnectionStateTest, ResetUnderSkipSendsAPingFirstAndHidesItsReply) {
  ConnectionState s;
  Send(s, "CLIENT REPLY SKIP");
  Sent reset = Send(s, "RESET");
  EXPECT_EQ(reset.p.kind, Kind::kReset);
  EXPECT_TRUE(reset.effects.ping_first);
  EXPECT_TRUE(reset.p.hidden);
  EXPECT_FALSE(reset.effects.silent);
  EXPECT_TRUE(reset.effects.logout);
  // RESET also ends OFF at once.
  Send(s, "CLIENT REPLY OFF");
  Sent r2 = Send(s, "RESET");
  EXPECT_FALSE(r2.effects.silent || r2.p.hidden || r2.effects.ping_first);
  EXPECT_FALSE(Send(s, "GET k").mode.silent);
}

TEST(ConnectionStateTest, RepliesSwitchProtocolMonitorAndResetEndsThem) {
  ConnectionState s;
  Sent hello = Send(s, "HELLO 3");
  EXPECT_EQ(hello.p.hello_version, 3);
  EXPECT_FALSE(s.OnReply(hello.p, /*error=*/true));
  EXPECT_EQ(s.protocol(), 2);  // a refused HELLO switches nothing
  s.OnReply(hello.p, false);
  EXPECT_EQ(s.protocol(), 3);
  EXPECT_EQ(Send(s, "HELLO").p.hello_version, 0);
  Sent monitor = Send(s, "MONITOR");
  s.OnReply(monitor.p, false);
  EXPECT_TRUE(s.monitor());
  s.TrackConfirmation("subscribe", "ch");
  EXPECT_TRUE(s.subscribed());
  Sent reset = Send(s, "RESET");
  EXPECT_TRUE(s.OnReply(reset.p, false));
  EXPECT_EQ(s.protocol(), 2);
  EXPECT_FALSE(s.monitor() || s.subscribed());
}

TEST(ConnectionStateTest, SubscriptionsCountConfirmations) {
  ConnectionState s;
  Sent sub = Send(s, "SUBSCRIBE a b");
  EXPECT_EQ(sub.p.kind, Kind::kSubscribe);
  EXPECT_EQ(sub.p.expected, 2);
  EXPECT_TRUE(s.IsConfirmationFor(sub.p, "SUBSCRIBE"));
  EXPECT_FALSE(s.IsConfirmationFor(sub.p, "psubscribe"));
  s.TrackConfirmation("subscribe", "a");
  s.TrackConfirmation("subscribe", "b");
  s.TrackConfirmation("psubscribe", "p*");
  s.TrackConfirmation("message", "a");  // not a confirmation
  EXPECT_EQ(s.subscriptions(0), 2u);
  EXPECT_EQ(s.subscriptions(1), 1u);
  Sent bare = Send(s, "UNSUBSCRIBE");  // every channel: as many confirmations as channels
  EXPECT_EQ(bare.p.kind, Kind::kSubscribe);
  EXPECT_EQ(bare.p.expected, -1);
  s.TrackConfirmation("unsubscribe", "a");
  EXPECT_EQ(s.subscriptions(0), 1u);
  Sent ssub = Send(s, "SSUBSCRIBE x");
  EXPECT_EQ(kConfirmNames[ssub.p.confirm], "ssubscribe");
  Send(s, "MULTI");
  EXPECT_EQ(Send(s, "SUBSCRIBE c").p.kind, Kind::kForward);  // queued: confirmations come with EXEC
}

// The role of a frame: its type and top-level scalars, as the reply framer gives them.
FrameRole Role(const ConnectionState& s, const Pending* front, char type, std::vector<std::string_view> scalars,
               bool filtered = false) {
  std::vector<resp::ReplyFramer::Scalar> head;
  for (std::string_view t : scalars) head.push_back({'$', t});
  return s.Classify(front, type, head, filtered);
}

TEST(ConnectionStateTest, FramesAreTheHeadsReplyOnlyWhenNothingElseExplainsThem) {
  ConnectionState s;
  Sent get = Send(s, "GET k");
  EXPECT_EQ(Role(s, &get.p, '$', {"v"}), FrameRole::kReply);
  EXPECT_EQ(Role(s, nullptr, '$', {"v"}), FrameRole::kUnexpected);
  // RESP2: an array that looks like a message is a reply until the connection is subscribed.
  EXPECT_EQ(Role(s, &get.p, '*', {"message", "ch", "x"}), FrameRole::kReply);
  Sent sub = Send(s, "SUBSCRIBE ch");
  EXPECT_EQ(Role(s, &sub.p, '*', {"subscribe", "ch", "1"}), FrameRole::kConfirmation);
  EXPECT_EQ(Role(s, &sub.p, '*', {"psubscribe", "ch", "1"}), FrameRole::kReply) << "not its confirmation";
  s.TrackConfirmation("subscribe", "ch");
  EXPECT_EQ(Role(s, &get.p, '*', {"message", "ch", "x"}), FrameRole::kPush);
  EXPECT_EQ(Role(s, &get.p, '*', {"pmessage", "p*", "ch", "x"}), FrameRole::kPush);
  EXPECT_EQ(Role(s, &get.p, '*', {"message"}), FrameRole::kReply) << "too short for a message";
  // RESP3: every push is out of band, a confirmation of the head's kind excepted.
  Sent hello = Send(s, "HELLO 3");
  s.OnReply(hello.p, false);
  EXPECT_EQ(Role(s, &get.p, '>', {"invalidate", "k"}), FrameRole::kPush);
  EXPECT_EQ(Role(s, &sub.p, '>', {"subscribe", "ch", "1"}), FrameRole::kConfirmation);
  EXPECT_EQ(Role(s, &sub.p, '*', {"subscribe", "ch", "1"}), FrameRole::kReply) << "RESP3 confirms with pushes";
  // MONITOR lines only once MONITOR took effect.
  const std::string_view line = "1700000000.123456 [0 127.0.0.1:5555] \"get\" \"k\"";
  EXPECT_EQ(Role(s, &get.p, '+', {line}), FrameRole::kReply);
  Sent monitor = Send(s, "MONITOR");
  s.OnReply(monitor.p, false);
  EXPECT_EQ(Role(s, &get.p, '+', {line}), FrameRole::kPush);
  EXPECT_EQ(Role(s, &get.p, '+', {"OK"}), FrameRole::kReply);
  EXPECT_FALSE(IsMonitorLine("1700000000 [0 x]")) << "no fraction";
  EXPECT_FALSE(IsMonitorLine("1.5 x"));
}

TEST(ConnectionStateTest, FilteredRepliesThatBreakTheExpectationAreADesync) {
  ConnectionState s;
  Sent multi = Send(s, "MULTI", /*tenant=*/true);
  EXPECT_EQ(Role(s, &multi.p, '+', {"OK"}, true), FrameRole::kReply);
  Sent get = Send(s, "GET k", true);
  EXPECT_EQ(Role(s, &get.p, '+', {"QUEUED"}, true), FrameRole::kReply);
  EXPECT_EQ(Role(s, &get.p, '$', {"v"}, true), FrameRole::kDesync) << "the server did not queue it";
  EXPECT_EQ(Role(s, &get.p, '$', {"v"}, false), FrameRole::kReply) << "unfiltered: passed on as it is";
  EXPECT_EQ(Role(s, &get.p, '-', {"ERR x"}, true), FrameRole::kReply) << "an error is always a possible reply";
  Send(s, "EXEC", true);
  Sent set = Send(s, "SET k v", true);  // outside MULTI: anything but +QUEUED
  EXPECT_EQ(Role(s, &set.p, '+', {"OK"}, true), FrameRole::kReply);
  EXPECT_EQ(Role(s, &set.p, '$', {"QUEUED"}, true), FrameRole::kReply);
  EXPECT_EQ(Role(s, &set.p, '+', {"QUEUED"}, true), FrameRole::kDesync);
  Pending internal;
  internal.kind = Kind::kInternal;
  EXPECT_EQ(Role(s, &internal, '+', {"OK"}, true), FrameRole::kInternal);
  Pending walk;
  walk.kind = Kind::kWalk;
  walk.expect = Expect::kNotQueued;
  EXPECT_EQ(Role(s, &walk, '*', {"0", "3", ""}, true), FrameRole::kWalkStep);
  EXPECT_EQ(Role(s, &walk, '+', {"QUEUED"}, true), FrameRole::kDesync);
}

TEST(ConnectionStateTest, QuitStopsReadingAndSyncStartsAStream) {
  ConnectionState s;
  Sent quit = Send(s, "QUIT");
  EXPECT_TRUE(quit.effects.stop_reading);
  EXPECT_TRUE(s.quit_sent());
  ConnectionState r;
  Sent sync = Send(r, "PSYNC ? -1");
  EXPECT_EQ(sync.p.kind, Kind::kReplicationStream);
  EXPECT_TRUE(r.replication_stream());
  EXPECT_TRUE(Send(r, "REPLCONF ACK 0").mode.silent);  // nothing after it gets a reply
  EXPECT_FALSE(r.tunnel());
  r.StartTunnel();
  EXPECT_TRUE(r.tunnel());
  // Under CLIENT REPLY OFF, SYNC's reply would not be read as a stream start.
  ConnectionState q;
  Send(q, "CLIENT REPLY OFF");
  EXPECT_EQ(Send(q, "SYNC").p.kind, Kind::kForward);
  EXPECT_FALSE(q.replication_stream());
}

TEST(ConnectionStateTest, ClientSetnameIsRemembered) {
  ConnectionState s;
  Send(s, "CLIENT SETNAME app-1");
  EXPECT_EQ(s.client_name(), "app-1");
  Send(s, "MULTI");
  Send(s, "CLIENT SETNAME queued");  // takes effect with EXEC, not followed
  EXPECT_EQ(s.client_name(), "app-1");
}

TEST(ReplyQueueTest, ExpectationsOfReplies) {
  EXPECT_TRUE(AsExpected(Expect::kQueued, '+', "QUEUED"));
  EXPECT_TRUE(AsExpected(Expect::kQueued, '-', "ERR unknown command"));
  EXPECT_FALSE(AsExpected(Expect::kQueued, '+', "OK"));
  EXPECT_FALSE(AsExpected(Expect::kNotQueued, '+', "QUEUED"));
  EXPECT_TRUE(AsExpected(Expect::kNotQueued, '$', "x"));
  EXPECT_FALSE(AsExpected(Expect::kMultiOk, '-', "ERR MULTI calls can not be nested"));
  EXPECT_FALSE(AsExpected(Expect::kExecInMulti, '-', "ERR EXEC without MULTI"));
  EXPECT_TRUE(AsExpected(Expect::kExecInMulti, '-', "EXECABORT Transaction discarded"));
  EXPECT_TRUE(AsExpected(Expect::kExecOutside, '-', "ERR EXEC without MULTI"));
  EXPECT_FALSE(AsExpected(Expect::kExecOutside, '*', "2"));
  EXPECT_TRUE(AsExpected(Expect::kAny, '+', "QUEUED"));
}

TEST(ReplyQueueTest, LocalRepliesWaitForTheRepliesBeforeThem) {
  ReplyQueue q;
  std::string now = "+first\r\n";
  EXPECT_FALSE(q.QueueLocal(now, 0, false));  // nothing pending: the caller sends it at once
  EXPECT_EQ(now, "+first\r\n");
  q.Push(Pending{});
  std::string a = "-ERR a\r\n", b = "-ERR b\r\n";
  EXPECT_TRUE(q.QueueLocal(a, 0, false));
  EXPECT_TRUE(q.QueueLocal(b, 0, true));
  EXPECT_FALSE(q.LocalAtHead());  // the forwarded command's reply comes first
  q.Pop();
  ASSERT_TRUE(q.LocalAtHead());
  EXPECT_TRUE(q.front().close_after == false);
  EXPECT_EQ(q.TakeLocal(), "-ERR a\r\n");
  ASSERT_TRUE(q.LocalAtHead());
  EXPECT_TRUE(q.front().close_after);
  EXPECT_EQ(q.TakeLocal(), "-ERR b\r\n");
  EXPECT_FALSE(q.LocalAtHead());
  EXPECT_TRUE(q.empty());
}

TEST(ReplyQueueTest, AbortOwesEveryCommandAnErrorInOrder) {
  ReplyQueue q;
  Pending internal;
  internal.kind = Kind::kInternal;
  q.Push(Pending(internal));
  EXPECT_FALSE(q.ClientWaiting());
  Pending get;
  get.command = commands::LookupCommand("get");
  q.Push(Pending(get));
  EXPECT_TRUE(q.ClientWaiting());
  std::string local = "+local\r\n";
  q.QueueLocal(local, 0, false);
  Pending set;
  set.command = commands::LookupCommand("set");
  q.Push(Pending(set));
  std::vector<commands::CommandId> failed;
  EXPECT_EQ(q.Abort("-ERR gone\r\n", &failed), "-ERR gone\r\n+local\r\n-ERR gone\r\n");
  EXPECT_EQ(failed, (std::vector<commands::CommandId>{get.command, set.command}));
  EXPECT_TRUE(q.empty());
}

TEST(ReplyQueueTest, EntriesKeepTheirOrderAcrossTheRingsWrapAndGrowth) {
  ReplyQueue q;
  uint16_t next_in = 1, next_out = 1;
  auto push = [&] {
    Pending p;
    p.command = next_in++;
    q.Push(std::move(p));
  };
  auto pop = [&] {
    ASSERT_FALSE(q.empty());
    EXPECT_EQ(q.front().command, next_out++);
    q.Pop();
  };
  // Steady pipelining of depth 10: the ring wraps many times and never grows past its first size.
  for (int i = 0; i < 10; ++i) push();
  const size_t capacity = q.capacity();
  for (int i = 0; i < 1000; ++i) {
    push();
    pop();
  }
  EXPECT_EQ(q.capacity(), capacity);
  // Grows while wrapped: the entries stay in order, iteration sees them head first.
  for (int i = 0; i < 3 * static_cast<int>(capacity); ++i) push();
  EXPECT_GT(q.capacity(), capacity);
  std::vector<commands::CommandId> seen;
  for (const Pending& p : q) seen.push_back(p.command);
  ASSERT_EQ(seen.size(), q.size());
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], next_out + i);
  std::string local = "+local\r\n";
  EXPECT_TRUE(q.QueueLocal(local, 0, false));
  while (!q.LocalAtHead()) pop();
  EXPECT_EQ(q.TakeLocal(), "+local\r\n");
  EXPECT_TRUE(q.empty());
  // A reused slot starts as a fresh entry: nothing of its previous occupant shows.
  push();
  EXPECT_EQ(q.front().kind, Kind::kForward);
  EXPECT_TRUE(q.front().text.empty());
}

TEST(ReplyQueueTest, KeysLiveUntilTheirEntryEndsAndTheArenaIsTrimmed) {
  ReplyQueue q;
  const std::string big(40 * 1024, 'x');
  Pending a, b, c;
  q.AttachKey(&a, big);
  q.Push(Pending(a));
  q.AttachKey(&b, "k2");
  q.Push(Pending(b));
  q.Push(Pending(c));  // no key
  EXPECT_EQ(q.KeyOf(q.front()), big);
  q.Pop();
  EXPECT_EQ(q.KeyOf(q.front()), "k2");  // offsets are absolute: still valid after a trim
  Pending d;
  q.AttachKey(&d, big);
  q.Push(Pending(d));
  q.Pop();
  q.Pop();  // c
  EXPECT_EQ(q.KeyOf(q.front()), big);
  EXPECT_GT(q.key_arena_bytes(), 2 * big.size());  // trimmed when the next key comes
  Pending e;
  q.AttachKey(&e, "k5");
  q.Push(Pending(e));
  EXPECT_LE(q.key_arena_bytes(), big.size() + 4);  // the consumed front was dropped
  EXPECT_EQ(q.KeyOf(q.front()), big);
  q.Pop();
  EXPECT_EQ(q.KeyOf(q.front()), "k5");
  q.Pop();
  EXPECT_EQ(q.key_arena_bytes(), 0u);  // an empty queue holds no keys
}

TEST(ScratchTest, BytesStayWhereTheyWereWrittenUntilReset) {
  Scratch s;
  char* a = s.Reserve(10);
  std::memcpy(a, "0123456789", 10);
  s.Commit(4);  // only "0123" is kept
  char* b = s.Reserve(3);
  EXPECT_EQ(b, a + 4) << "the next bytes follow in the same chunk";
  std::memcpy(b, "abc", 3);
  s.Commit(3);
  char* big = s.Reserve(200 * 1024);  // more than a chunk: a new one, the old bytes do not move
  EXPECT_NE(big, a + 7);
  s.Commit(200 * 1024);
  EXPECT_EQ(std::string(a, 7), "0123abc");
  s.Reset();
  EXPECT_EQ(s.Reserve(1), a) << "the first chunk is reused";
}

}  // namespace
}  // namespace keyguard::proxy
