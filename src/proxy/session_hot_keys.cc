// Session hooks of the hot and big key tracking (hygiene::HotKeys, one per worker). Kept apart
// from session.cc's detectors: two calls there (HandleCommand, CompleteHead) lead here.
//
// Hot keys count the command's first key only when the command table says it is args[1] (GET,
// SET, HGETALL, INCR, ...): no FindKeys on the hot path. The key is the client's own name (before
// tenant prefixing or key-policy rewrites), with the tenant reported beside it.
#include <vector>

#include "keyguard/commands/command_table.h"
#include "keyguard/resp/framer.h"
#include "proxy/session.h"

namespace keyguard::proxy {
namespace {

// What a command's reply says about its first key's size.
enum class SizeReply : uint8_t {
  kNone,
  kBulkBytes,          // GET: the bulk is the value
  kIntegerBytes,       // STRLEN
  kIntegerElements,    // HLEN, SCARD, LLEN, ZCARD, XLEN
  kAggregateElements,  // HGETALL, SMEMBERS, LRANGE, ZRANGE, XRANGE
};

struct HotKeyInfo {
  bool first_key = false;  // args[1] is the first key
  int8_t value_pos = 0;    // a string write: position of its value (0: none)
  bool pairs = false;      // MSET: key value pairs from position 1
  SizeReply size_reply = SizeReply::kNone;
  bool field_value_pairs = false;  // RESP2 HGETALL: two elements per member
  std::string_view type;           // the key's type, as far as the command tells
};

const std::vector<HotKeyInfo>& HotKeyTable() {
  static const std::vector<HotKeyInfo> table = [] {
    std::vector<HotKeyInfo> t(commands::CommandCount());
    for (size_t id = 1; id < t.size(); ++id) {
      const commands::CommandSpec& spec = commands::Spec(static_cast<commands::CommandId>(id));
      if (spec.sub_count > 0) continue;  // OBJECT, XINFO, ...: args[1] is a subcommand
      const auto specs = commands::KeySpecs(spec);
      t[id].first_key = !specs.empty() && specs[0].begin == commands::KeySpec::kIndex && specs[0].index == 1 &&
                        (specs[0].flags & commands::kKeyNotKey) == 0;
    }
    auto at = [&](const char* name) -> HotKeyInfo& { return t[commands::LookupCommand(name)]; };
    auto sized = [&](std::initializer_list<const char*> names, SizeReply r, std::string_view type) {
      for (const char* n : names) {
        at(n).size_reply = r;
        at(n).type = type;
      }
    };
    for (const char* n : {"set", "setnx", "getset", "append"}) at(n).value_pos = 2;
    for (const char* n : {"setex", "psetex"}) at(n).value_pos = 3;
    for (const char* n : {"mset", "msetnx"}) at(n).pairs = true;
    for (const char* n : {"set", "setnx", "getset", "append", "setex", "psetex", "mset", "msetnx"})
      at(n).type = "string";
    sized({"get", "getex", "getdel"}, SizeReply::kBulkBytes, "string");
    sized({"strlen"}, SizeReply::kIntegerBytes, "string");
    sized({"hlen"}, SizeReply::kIntegerElements, "hash");
    sized({"scard"}, SizeReply::kIntegerElements, "set");
    sized({"llen"}, SizeReply::kIntegerElements, "list");
    sized({"zcard"}, SizeReply::kIntegerElements, "zset");
    sized({"xlen"}, SizeReply::kIntegerElements, "stream");
    sized({"hgetall", "hkeys", "hvals"}, SizeReply::kAggregateElements, "hash");
    sized({"smembers"}, SizeReply::kAggregateElements, "set");
    sized({"lrange"}, SizeReply::kAggregateElements, "list");
    sized({"zrange", "zrevrange", "zrangebyscore", "zrevrangebyscore", "zrangebylex", "zrevrangebylex"},
          SizeReply::kAggregateElements, "zset");
    sized({"xrange", "xrevrange"}, SizeReply::kAggregateElements, "stream");
    at("hgetall").field_value_pairs = true;
    return t;
  }();
  return table;
}

}  // namespace

bool Session::HotKeysRequest(commands::CommandId id, std::span<const std::string_view> args, size_t raw_len,
                             Pending* p) {
  hygiene::HotKeys& hot = worker_.hot;
  if (!hot.enabled() || args.size() < 2) return false;
  const std::vector<HotKeyInfo>& table = HotKeyTable();
  if (id >= table.size()) return false;
  const HotKeyInfo& info = table[id];
  if (info.value_pos > 0 || info.pairs) {
    const std::string_view tenant = tenant_ != nullptr ? std::string_view(tenant_->name) : std::string_view();
    auto write = [&](std::string_view key, std::string_view value) {
      if (value.empty() || !hot.Admits(false, value.size())) return;
      hot.ObserveSize(absl::string_view(tenant.data(), tenant.size()), absl::string_view(key.data(), key.size()), false,
                      value.size(), commands::CommandName(id), info.type);
    };
    if (info.value_pos > 0 && args.size() > static_cast<size_t>(info.value_pos)) {
      write(args[1], args[info.value_pos]);
    } else if (info.pairs) {
      for (size_t i = 1; i + 1 < args.size(); i += 2) write(args[i], args[i + 1]);
    }
  }
  if (!info.first_key) return false;
  // Sampled commands count as accesses; the replies of sizing commands are always looked at.
  if (hot.Sample()) p->request_bytes = static_cast<uint32_t>(std::min<size_t>(raw_len, UINT32_MAX));
  return p->request_bytes != 0 || info.size_reply != SizeReply::kNone;
}

void Session::HotKeysReply(const Pending& p, char type, int64_t size, std::string_view bulk, size_t frame_len) {
  hygiene::HotKeys& hot = worker_.hot;
  const std::string_view arena_key = queue_.KeyOf(p);
  const absl::string_view key(arena_key.data(), arena_key.size());
  const absl::string_view tenant = tenant_ != nullptr ? absl::string_view(tenant_->name) : absl::string_view();
  if (p.request_bytes != 0) hot.Access(tenant, key, p.request_bytes + frame_len);
  const HotKeyInfo& info = HotKeyTable()[p.command];
  if (info.size_reply == SizeReply::kNone) return;
  int64_t n = -1;
  bool elements = true;
  switch (info.size_reply) {
    case SizeReply::kBulkBytes:
      if (type == '$') n = static_cast<int64_t>(bulk.size());
      elements = false;
      break;
    case SizeReply::kIntegerBytes:
    case SizeReply::kIntegerElements:
      if (type == ':' && !resp::ParseRedisInt(bulk, &n)) n = -1;
      elements = info.size_reply == SizeReply::kIntegerElements;
      break;
    case SizeReply::kAggregateElements:
      if (type == '*' || type == '~' || type == '%') n = (type == '*' && info.field_value_pairs) ? size / 2 : size;
      break;
    case SizeReply::kNone: break;
  }
  if (n <= 0 || !hot.Admits(elements, static_cast<uint64_t>(n))) return;
  hot.ObserveSize(tenant, key, elements, static_cast<uint64_t>(n), commands::CommandName(p.command), info.type);
}

}  // namespace keyguard::proxy
