// The per-command pipeline: what keyguard decides about one client command before anything is
// sent. Sans-io: a CommandContext (the command and what the connection is in) runs through the
// stages in order, and the first that does not pass it ends the run with one Verdict:
//
//   gate (tenancy: AUTH/HELLO, NOAUTH, what tenants may not do on this connection)
//   -> access (unknown commands, the deny list)
//   -> key policy (key_policy.scripts, then each key against the rules: observe, warn, rewrite, reject)
//   -> tenant (prefixes keys, patterns and channels; or walks the tenant's keys; or refuses)
//   -> hygiene (the traffic detectors: findings, their rewrites and refusals)
//
// Rewritten arguments are owned here (the stages' outputs and one hygiene::ArgEditor) until
// Release(); the session turns the verdict into bytes and replies. Unit-tested without sockets
// (tests/unit/pipeline_test.cc).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "keyguard/commands/command_table.h"
#include "keyguard/config/config.h"
#include "keyguard/config/config_store.h"
#include "keyguard/hygiene/traffic.h"
#include "keyguard/metrics/registry.h"
#include "keyguard/policy/key_policy.h"
#include "keyguard/resp/value.h"
#include "keyguard/tenant/connections.h"
#include "keyguard/tenant/rewrite.h"
#include "proxy/connection_state.h"
#include "proxy/refusal.h"
#include "proxy/reply_queue.h"

namespace keyguard::proxy {

// What the stages read and count, shared by one worker's sessions (used from its thread only).
struct StageShared {
  // `conns`: the process-wide registry of tenant connections (with tenancy; it outlives this).
  StageShared(const config::ProxyConfig& c, config::ConfigStore& st, metrics::WorkerShard* s,
              tenant::Connections* conns = nullptr);

  // Takes the live snapshot when the store has a new version: one relaxed load per batch.
  void Refresh();

  const config::ProxyConfig& config;  // settings fixed at start-up
  config::ConfigStore& store;
  std::shared_ptr<const config::ProxyConfig> live;  // reloadable settings (key policy, deny list)
  uint64_t live_version = 0;
  bool maps_patterns = false;  // live->key_policy->maps_patterns(), one load on every command's path
  // By command id, from `live`: the access stage's refusal (0: none, else a Refusal + 1:
  // kDenyList, or kUnknownCommand for the unknown command id), one load per command.
  std::vector<uint8_t> access;
  static constexpr uint8_t kSharedWait = 0xFF;  // access: WAIT/WAITAOF with shared connections (Access)
  metrics::WorkerShard* shard;
  std::array<metrics::Counter*, kRefusalCount> rejected{};  // keyguard_commands_rejected_total by reason
  tenant::Connections* connections;                   // with tenancy: which tenant each upstream connection serves
  commands::CommandId auth;                           // AUTH, which the gate answers
  std::unique_ptr<tenant::RequestRewriter> rewriter;  // with tenancy
  int64_t warn_second = 0;                            // rate limit of key-policy warn lines
  int warn_count = 0;
  // The upstream refused the last legacy-key move a connection of this worker sent (NOPERM: its
  // user may not EVAL): moves are not queued inside MULTI, where a refusal aborts the transaction,
  // until one outside MULTI succeeds again.
  bool moves_refused = false;

  // keyguard_key_violations_total for a rule of `live`, the action taken and a key pattern label
  // (a WorkerShard::PatternLabel reference): resolved once per triple.
  metrics::Counter& KeyViolations(const policy::Rule& rule, policy::Action action, const std::string& pattern) {
    return violation_handles.Get({&rule, action, &pattern}, [&]() -> metrics::Counter& {
      return shard->key_violations.Get({rule.name, policy::ActionName(action), pattern});
    });
  }
  // keyguard_keys_rewritten_total for a rule of `live`.
  metrics::Counter& KeysRewritten(const policy::Rule& rule) {
    return rewrite_handles.Get(&rule, [&]() -> metrics::Counter& { return shard->keys_rewritten.Get({rule.name}); });
  }
  metrics::HandleCache<std::tuple<const policy::Rule*, policy::Action, const std::string*>> violation_handles;
  metrics::HandleCache<const policy::Rule*> rewrite_handles;
};

// One client command and what its connection is in, as the stages see it.
struct CommandContext {
  commands::CommandId id = commands::kUnknownCommand;
  std::span<const std::string_view> args;  // as the client sent them, the name first
  ConnectionState::ReplyMode mode;         // CLIENT REPLY OFF/SKIP (and a replication stream)
  const tenant::Tenant* tenant = nullptr;  // the client's tenant: nullptr without one (yet)
  const ConnectionState* state = nullptr;
  const ReplyQueue* queue = nullptr;  // what is pending (a subscribe still unconfirmed)
  std::string_view client;            // its address, for warn lines
  bool upstream_ready = true;         // false: the upstream connection failed
  bool own_upstream = true;           // the client's commands go to a connection of its own (not shared)
};

// The outcome of a command's run through the stages.
struct Verdict {
  enum class Action : uint8_t {
    kForward,      // send `args` (the client's own bytes when not `modified`)
    kRefuse,       // answer `message` as an error in the command's place; nothing is sent
    kLogin,        // AUTH or HELLO accepted: bind `login` when `bind`; HELLO sends `args` (its AUTH removed)
    kWalk,         // tenancy: walk the tenant's keys (`walk`) and answer in the command's place
    kUnavailable,  // no upstream connection: answer that, and close
  };
  Action action = Action::kForward;
  Refusal reason = Refusal::kTenant;  // kRefuse
  std::string message;                // kRefuse: the error text, without '-'
  std::span<const std::string_view> args;
  bool modified = false;
  bool bind = false;
  const tenant::Tenant* login = nullptr;
  uint8_t rewrite = 0;      // kForward: the tenant::ReplyRewrite of its reply
  uint8_t reply_check = 0;  // kForward: what the detectors read in its reply
  tenant::Walk walk = tenant::Walk::kNone;
  // kForward: keyguard's own command to send first (empty: none): the EVAL that moves keys stored
  // under a rewrite rule's old names to their new names (LegacyKeys MOVE). Its reply is the number
  // of keys moved, and is not the client's.
  std::span<const std::string_view> prelude;
  // kForward: the key names the reply carries (BLPOP's, XREAD's: `renamed_shape`, a
  // tenant::ReplyRewrite) that the key policy renamed: (new name, the client's).
  std::span<const std::pair<std::string_view, std::string_view>> renamed;
  uint8_t renamed_shape = 0;
};

// The script of a Verdict's prelude: for each pair of keys (old name, new name) with its ARGV
// ("w" when the command writes the key, else "r"): when the old key exists and the new one does
// not, RENAME the old onto the new (atomic; the TTL moves with it). When both exist the new key
// wins: a write removes the old copy, which it makes stale; a read leaves both. Returns how many
// keys it moved.
inline constexpr std::string_view kMoveLegacyScript =
    "local n=0 for i=1,#KEYS,2 do if redis.call('EXISTS',KEYS[i])==1 then "
    "if redis.call('EXISTS',KEYS[i+1])==0 then redis.call('RENAME',KEYS[i],KEYS[i+1]) n=n+1 "
    "elseif ARGV[(i+1)/2]=='w' then redis.call('UNLINK',KEYS[i]) end end end return n";

// kMoveLegacyScript for moves where a rule reshapes (json_to_hash): an ARGV of "rj" or "wj" turns
// an old string holding a JSON object into a Hash under the new name, field by field as
// `keyguard migrate`'s json_to_hash makes it (maintenance::JsonToHash, nested as JSON text: RFC
// 8259, a string field as its text, any other value as its JSON text with only the whitespace
// between tokens removed), with the old key's expiry (PEXPIREAT of its PEXPIRETIME); a value it
// cannot reshape (not such an object, {}, a repeated field name, another type) is renamed as it is.
inline constexpr std::string_view kMoveLegacyJsonScript = R"lua(
local function sp(s,i) while true do local c=string.byte(s,i) if c==32 or c==9 or c==10 or c==13 then i=i+1 else return i end end end
local esc={['"']='"',['\\']='\\',['/']='/',b='\b',f='\f',n='\n',r='\r',t='\t'}
local function hex(s,i) local h=string.sub(s,i,i+3) if string.find(h,'^%x%x%x%x$') then return tonumber(h,16) end end
local function str(s,i)
  i=i+1 local out={}
  while true do
    local c=string.byte(s,i)
    if not c or c<32 then return nil end
    if c==34 then return table.concat(out),i+1 end
    if c==92 then
      local e=string.sub(s,i+1,i+1) i=i+2
      if esc[e] then out[#out+1]=esc[e]
      elseif e=='u' then
        local cp=hex(s,i) if not cp then return nil end i=i+4
        if cp>=0xD800 and cp<=0xDBFF then
          if string.sub(s,i,i+1)~='\\u' then return nil end
          local lo=hex(s,i+2) if not lo or lo<0xDC00 or lo>0xDFFF then return nil end
          cp=0x10000+(cp-0xD800)*1024+(lo-0xDC00) i=i+6
        elseif cp>=0xDC00 and cp<=0xDFFF then return nil end
        if cp<0x80 then out[#out+1]=string.char(cp)
        elseif cp<0x800 then out[#out+1]=string.char(0xC0+math.floor(cp/64),0x80+cp%64)
        elseif cp<0x10000 then out[#out+1]=string.char(0xE0+math.floor(cp/4096),0x80+math.floor(cp/64)%64,0x80+cp%64)
        else out[#out+1]=string.char(0xF0+math.floor(cp/262144),0x80+math.floor(cp/4096)%64,0x80+math.floor(cp/64)%64,0x80+cp%64) end
      else return nil end
    else
      local j=i
      while true do local d=string.byte(s,j) if not d or d==34 or d==92 or d<32 then break end j=j+1 end
      out[#out+1]=string.sub(s,i,j-1) i=j
    end
  end
end
local function name(s,i)
  i=sp(s,i) if string.byte(s,i)~=34 then return nil end
  local t,j=str(s,i) if not t then return nil end
  j=sp(s,j) if string.byte(s,j)~=58 then return nil end
  return t,j+1
end
local function digits(s,i) local j=i while true do local c=string.byte(s,j) if c and c>=48 and c<=57 then j=j+1 else break end end return j,j>i end
local function num(s,i)
  local ok
  if string.byte(s,i)==45 then i=i+1 end
  if string.byte(s,i)==48 then i=i+1 else i,ok=digits(s,i) if not ok then return nil end end
  if string.byte(s,i)==46 then i,ok=digits(s,i+1) if not ok then return nil end end
  local c=string.byte(s,i)
  if c==101 or c==69 then
    i=i+1 c=string.byte(s,i) if c==43 or c==45 then i=i+1 end
    i,ok=digits(s,i) if not ok then return nil end
  end
  return i
end
local function value(s,i)
  local open={}
  while true do
    i=sp(s,i) local c=string.byte(s,i) local scalar=true
    if not c then return nil end
    if c==123 or c==91 then
      local close=125 if c==91 then close=93 end
      i=sp(s,i+1)
      if string.byte(s,i)==close then i=i+1
      else
        open[#open+1]=close scalar=false
        if close==125 then local t t,i=name(s,i) if not t then return nil end end
      end
    elseif c==34 then local t t,i=str(s,i) if not t then return nil end
    elseif c==45 or (c>=48 and c<=57) then i=num(s,i) if not i then return nil end
    elseif string.sub(s,i,i+3)=='true' or string.sub(s,i,i+3)=='null' then i=i+4
    elseif string.sub(s,i,i+4)=='false' then i=i+5
    else return nil end
    while scalar do
      if #open==0 then return i end
      i=sp(s,i) local d=string.byte(s,i)
      if d==open[#open] then open[#open]=nil i=i+1
      elseif d==44 then
        i=i+1 scalar=false
        if open[#open]==125 then local t t,i=name(s,i) if not t then return nil end end
      else return nil end
    end
  end
end
local function compact(v)
  local out={} local i=1 local ins=false
  while i<=#v do
    local c=string.sub(v,i,i)
    if ins then
      out[#out+1]=c
      if c=='\\' then out[#out+1]=string.sub(v,i+1,i+1) i=i+1 elseif c=='"' then ins=false end
    elseif not (c==' ' or c=='\t' or c=='\n' or c=='\r') then out[#out+1]=c ins=c=='"' end
    i=i+1
  end
  return table.concat(out)
end
local function fields(s)
  local i=sp(s,1)
  if string.byte(s,i)~=123 then return nil end
  i=sp(s,i+1)
  if string.byte(s,i)==125 then return nil end
  local f,seen={},{}
  while true do
    local k k,i=name(s,i) if not k then return nil end
    i=sp(s,i) local st=i
    i=value(s,i) if not i then return nil end
    if seen[k] then return nil end seen[k]=true
    local v=string.sub(s,st,i-1)
    if string.byte(v,1)==34 then v=str(v,1) else v=compact(v) end
    f[#f+1]=k f[#f+1]=v
    i=sp(s,i) local d=string.byte(s,i)
    if d==44 then i=i+1 elseif d==125 then i=i+1 break else return nil end
  end
  if sp(s,i)<=#s then return nil end
  return f
end
local n=0
for i=1,#KEYS,2 do
  local a=ARGV[(i+1)/2]
  if redis.call('EXISTS',KEYS[i])==1 then
    if redis.call('EXISTS',KEYS[i+1])==0 then
      local f=nil
      if string.sub(a,2,2)=='j' and redis.call('TYPE',KEYS[i]).ok=='string' then f=fields(redis.call('GET',KEYS[i])) end
      if f then
        local t=redis.call('PEXPIRETIME',KEYS[i])
        for j=1,#f,1000 do redis.call('HSET',KEYS[i+1],unpack(f,j,math.min(j+999,#f))) end
        if t>0 then redis.call('PEXPIREAT',KEYS[i+1],t) end
        redis.call('DEL',KEYS[i])
      else redis.call('RENAME',KEYS[i],KEYS[i+1]) end
      n=n+1
    elseif string.sub(a,1,1)=='w' then redis.call('UNLINK',KEYS[i]) end
  end
end
return n)lua";

// KEYS of a pattern that may name old names of a rule that maps patterns: ARGV[1] is the
// client's pattern (the tenant's), the rest each rule's glob of new names. The reply is every
// key each finds, one list (a key may come twice; the reply filter keeps it once).
inline constexpr std::string_view kKeysWithNewNamesScript =
    "local r=redis.call('KEYS',ARGV[1]) for i=2,#ARGV do for _,k in ipairs(redis.call('KEYS',ARGV[i])) do "
    "r[#r+1]=k end end return r";

// SORT (or SORT_RO) whose BY or GET pattern names old names of a rule that maps patterns
// (SortWithNewNames). KEYS[1] is the key to sort, KEYS[2] STORE's destination (when there is
// one); ARGV[1] is SORT or SORT_RO, ARGV[6..] the server's SORT arguments after the key (without
// STORE), each such GET given twice: the old names' pattern, then the new names'. ARGV[2] says
// what each column of the output is made of: 'p' one column as the server returned it, 'm' two
// (old, new): the new name's value when the new key holds one, else the old's. ARGV[3] is empty
// when the server sorted; else BY named old names too: the server returned every element (`BY
// nosort GET # GET <old BY> GET <new BY>` first) and the script sorts as SORT does, 'A' ALPHA and
// 'D' DESC (numeric weights as strtod reads them, an overflow or underflow refused, ties in byte
// order; ALPHA compares with strcoll, in byte order with STORE, a missing weight first), then keeps
// LIMIT ARGV[4] ARGV[5] and the columns after the first two.
// STORE writes the result as SORT does (a list, nil as "", the key deleted when it is empty).
inline constexpr std::string_view kSortWithNewNamesScript =
    "local r=redis.pcall(ARGV[1],KEYS[1],unpack(ARGV,6)) if type(r)~='table' or r.err then return r end "
    "local lay=ARGV[2] local w=0 for i=1,#lay do if string.sub(lay,i,i)=='m' then w=w+2 else w=w+1 end end "
    "local rows={} for i=1,#r,w do local row={} local j=i for k=1,#lay do "
    "if string.sub(lay,k,k)=='m' then local v=r[j+1] if v==false then v=r[j] end row[k]=v j=j+2 "
    "else row[k]=r[j] j=j+1 end end rows[#rows+1]=row end "
    "local f=ARGV[3] local first=1 if f~='' then first=3 "
    "local alpha=string.find(f,'A',1,true) local desc=string.find(f,'D',1,true) "
    "local function bin(a,b) if a==b then return 0 end for i=1,math.min(#a,#b) do "
    "local x,y=string.byte(a,i),string.byte(b,i) if x~=y then if x<y then return -1 end return 1 end end "
    "if #a<#b then return -1 end return 1 end "
    "if not alpha then for _,row in ipairs(rows) do local v=row[2] local n=0 if v and v~='' then n=tonumber(v) "
    "if n==nil or n~=n or string.find(v,'%s$') or ((n==math.huge or n==-math.huge) and "
    "not string.find(string.lower(v),'inf',1,true)) or (n~=0 and math.abs(n)<2.2250738585072014e-308) or "
    "(n==0 and string.find(string.match(v,'^[^eEpP]*'),'[1-9]')) then "
    "return redis.error_reply(\"ERR One or more scores can't be converted into double\") end end row[2]=n end end "
    "table.sort(rows,function(a,b) local c=0 if alpha then local x,y=a[2],b[2] "
    "if x==false or y==false then if x~=y then if x==false then c=-1 else c=1 end end "
    "elseif KEYS[2] then c=bin(x,y) elseif x<y then c=-1 elseif y<x then c=1 end "
    "elseif a[2]<b[2] then c=-1 elseif a[2]>b[2] then c=1 else c=bin(a[1],b[1]) end "
    "if desc then c=-c end return c<0 end) end "
    "local n=#rows local s=tonumber(ARGV[4]) local cnt=tonumber(ARGV[5]) if s<0 then s=0 end "
    "local e=s+cnt-1 if cnt<0 then e=n-1 end if s>=n then s=n-1 e=n-2 end if e>=n then e=n-1 end "
    "local out={} for i=s+1,e+1 do local row=rows[i] for k=first,#lay do out[#out+1]=row[k] end end "
    "if KEYS[2] then redis.call('DEL',KEYS[2]) for i=1,#out,1000 do local chunk={} "
    "for k=i,math.min(i+999,#out) do local v=out[k] if v==false then v='' end chunk[#chunk+1]=v end "
    "redis.call('RPUSH',KEYS[2],unpack(chunk)) end return #out end return out";

class CommandPipeline {
 public:
  CommandPipeline(StageShared& shared, hygiene::ConnectionDetectors& detectors);

  // Runs `c` through the stages. The verdict's views stay valid until Release().
  const Verdict& Run(const CommandContext& c);
  // The verdict has been encoded (or answered): what the stages owned for it may go.
  void Release() { edit_.Release(); }
  // The keyspace patterns KeyspacePatterns replaced on this connection, (the server's, the
  // client's), kept by the connection while subscribed (Connection::KeepRenamedPatterns).
  std::vector<std::pair<std::string, std::string>>& patterns_renamed() { return patterns_renamed_; }

 private:
  // Each stage returns false when the run ends with it (v_ says how).
  bool Gate(const CommandContext& c);  // with tenancy only
  bool Login(const CommandContext& c);
  bool Access(const CommandContext& c);  // for a command the access table refuses
  bool ScriptPolicy(const CommandContext& c);
  bool KeyPolicy(const CommandContext& c, const commands::CommandSpec& spec);
  bool Tenant(const CommandContext& c, const commands::CommandSpec* spec, bool keys_ok);
  bool Hygiene(const CommandContext& c);
  // The rules `suggestion` (a rule's suggested name for a key) breaks under the command, in a
  // buffer reused by every call (the caller's own violation list stays as it is).
  const std::vector<policy::Violation>& SuggestionBreaks(const policy::KeyPolicy& policy, const CommandContext& c,
                                                         const commands::CommandSpec& spec,
                                                         std::string_view suggestion);
  // Whether the name rule violation `v` rewrites a key to is itself rewritten by a rewrite rule
  // (a chain or a cycle of rules, which would move one client's keys onto another's).
  bool RewrittenAgain(const policy::KeyPolicy& policy, const CommandContext& c, const commands::CommandSpec& spec,
                      const policy::Violation& v);
  // Encodes the prelude that moves the legacy keys the key policy rewrote.
  bool MoveLegacy(const CommandContext& c);
  // KEYS and SCAN MATCH with a pattern that may name old names of a rule that maps patterns
  // (policy::Rule::maps_patterns): the reply filter (OldNamesMatching) gets the pattern, SCAN
  // goes without MATCH; KEYS becomes KeysWithNewNames once the tenant stage has run.
  [[gnu::noinline]] void OldNamePatterns(const CommandContext& c);
  // CLIENT TRACKING ON BCAST with a PREFIX of old names: the new names' prefix is added.
  void BroadcastPrefixes(const CommandContext& c);
  // (UN)SUBSCRIBE of the keyspace channel of an old name: its new name's channel instead, and
  // the pairs (new channel, the client's) in `renamed` with the shape kChannelArray.
  void KeyspaceChannels(const CommandContext& c);
  // P(UN)SUBSCRIBE of a keyspace pattern that may match old names: PSUBSCRIBE gets a pattern that
  // also matches the new names (CoverPattern, unique on the connection) and the pairs (it, the
  // client's) in `renamed` with the shape kRenamedPatterns; PUNSUBSCRIBE names the one it got.
  void KeyspacePatterns(const CommandContext& c);
  // The arguments at `at` replaced by channel_space_'s (in order), and with `shape` the pairs
  // (channel_space_'s, the client's) in `renamed`.
  void RenameArgs(const CommandContext& c, const std::vector<size_t>& at, std::optional<uint8_t> shape);
  [[gnu::noinline]] void KeysWithNewNames();
  // SORT with a BY or GET pattern `<old_head>*<old_tail>` of a one-group rule that maps patterns:
  // kSortWithNewNamesScript, which reads each key under its new name, else its old one.
  [[gnu::noinline]] void SortWithNewNames(const CommandContext& c);
  // Ends the run with a refusal.
  bool Refuse(Refusal reason, std::string message);
  void Warn(const CommandContext& c, const policy::Rule& rule, std::string_view suggestion, std::string_view key);

  StageShared& shared_;
  hygiene::ConnectionDetectors& detectors_;
  Verdict v_;
  std::vector<commands::KeyRef> key_refs_;
  std::vector<policy::Violation> violations_;
  std::vector<policy::Violation> suggestion_violations_;  // SuggestionBreaks
  std::vector<std::string_view> policy_args_;             // the key policy's rewrites (strings owned by edit_)
  std::vector<std::string_view> tenant_args_;             // the tenant's (strings owned by shared_.rewriter)
  std::vector<std::string_view> hello_args_;              // HELLO without its AUTH
  // Rewritten keys whose rule moves legacy keys: the position, the client's (old) name, and
  // whether the command writes the key.
  struct Legacy {
    uint32_t pos;
    std::string_view old;
    bool write;
    bool json = false;  // the rule reshapes: json_to_hash
  };
  std::vector<Legacy> legacy_;
  std::vector<std::string_view> prelude_;  // EVAL, the script, the key count, then the keys
  std::vector<std::pair<std::string_view, std::string_view>> renamed_;
  std::string legacy_count_;  // the key count
  std::string legacy_space_;  // tenants' prefixed old names
  hygiene::ArgEditor edit_;   // the detectors' rewrites, and every owned string
  const commands::KnownCommands& known_ = commands::Known();
  // OldNamePatterns: a KEYS command's new-name globs (its arguments' views, until Release).
  std::vector<std::string> pattern_space_;
  // What is still to be done once every stage has passed the command (a refusal clears it):
  // KeysWithNewNames, SortWithNewNames.
  enum class After : uint8_t { kNone, kKeys, kSort };
  After after_ = After::kNone;
  std::vector<std::string> channel_space_;  // KeyspaceChannels: the new names' channels
  std::vector<std::string> sort_space_;     // SortWithNewNames: the new names' patterns, its flags
  std::vector<std::string_view> pattern_args_;
  std::vector<std::pair<std::string, std::string>> patterns_renamed_;
};

// Verdict::renamed_shape of KeyspacePatterns' pairs: kept by the connection (not a reply rewrite).
inline constexpr uint8_t kRenamedPatterns = 0xF0;
// At most this many keyspace patterns (and, apart, channels) are renamed per connection; beyond
// it they go as the client gave them.
inline constexpr size_t kMaxRenamedSubscriptions = 1024;

// The glob keyguard subscribes to for the keyspace pattern `pattern` (its head
// `__keyspace@<db>__:` is `head` bytes) when it may match old names of `rules`: the head, then
// the literal start of the key pattern merged character by character with each rule's new-name
// head (`User_*` and `user:` give `[Uu]ser[_:]`), then "**". It matches every channel `pattern`
// does and those of the new names; what it matches beyond is dropped (RenamePatterns).
std::string CoverPattern(std::string_view pattern, size_t head, std::span<const policy::Rule* const> rules);

// A pub/sub push on a connection with renamed keyspace patterns (pairs: the server's, the
// client's; kept for the connection's life, so a PUNSUBSCRIBE and a PSUBSCRIBE of the same pattern
// in flight at once find it): psubscribe and punsubscribe confirmations name the client's pattern;
// a pmessage of a renamed pattern names it, and its channel stays when the
// client's pattern matches it, becomes the old name's when that matches (the key a reversible
// rule renamed), else the message is dropped. kReplace puts the frame in `out`.
tenant::ReplyAction RenamePatterns(const policy::KeyPolicy& policy,
                                   std::vector<std::pair<std::string, std::string>>* pairs, std::string_view frame,
                                   std::string* out);

// A key as error texts show it: printable ASCII as it is, any other byte (and the quote and the
// backslash) as \xNN, at most 64 bytes of the key, then its size.
std::string KeyInError(std::string_view key);

// Whether `v` is a simple or bulk string equal to `word` ignoring ASCII case (a push's kind).
bool IsWord(const resp::Value& v, std::string_view word);

// A tracking invalidation (a RESP3 `invalidate` push, or RESP2's message on
// __redis__:invalidate to a REDIRECT connection) with, after each key a reversible rewrite rule
// made, the old name it was made from: a client that read the old name caches the value under
// that name. kReplace puts the new frame in `out`; anything else passes.
tenant::ReplyAction InvalidateOldNames(const policy::KeyPolicy& policy, std::string_view frame, std::string* out);

// The reply of KEYS (shape kKeyArray) or SCAN (kScan) sent for `pattern` by OldNamePatterns,
// without the tenant's prefix: each key that matches `pattern` stays, each new name whose old
// name (a rule that maps patterns) matches it becomes that old name, any other key goes; KEYS
// lists each name once. kReplace puts the new frame in `out`.
tenant::ReplyAction OldNamesMatching(const policy::KeyPolicy& policy, uint8_t shape, std::string_view pattern,
                                     std::string_view frame, std::string* out);

// Whether the connection has, or may have by the time the server reads the next command, a
// subscription: a tracked channel or a (un)subscribe still waiting for its confirmations.
bool MayBeSubscribed(const ConnectionState& state, const ReplyQueue& queue);

}  // namespace keyguard::proxy
