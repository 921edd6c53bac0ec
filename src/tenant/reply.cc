// Reply side of tenancy: the prefix comes off every key name a reply carries, and anything that
// names another tenant's keys or channels is removed, never shown.
#include <algorithm>
#include <deque>

#include "absl/strings/str_cat.h"
#include "keyguard/resp/encoder.h"
#include "keyguard/resp/framer.h"
#include "keyguard/resp/value.h"
#include "keyguard/tenant/rewrite.h"
#include "keyguard/common/views.h"

namespace keyguard::tenant {
namespace {

using resp::Value;

constexpr std::string_view kUnconfinable = "-ERR keyguard: the reply could not be confined to the tenant\r\n";

bool StartsWith(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

bool IsString(const Value& v) { return !v.null && (v.type == '$' || v.type == '+' || v.type == '='); }

// Removes the elements of keyguard's own queued commands from an EXEC reply; true when any went.
bool DropOwn(Value& v, std::span<const uint8_t> exec) {
  constexpr auto kOwn = static_cast<uint8_t>(ReplyRewrite::kOwn);
  if (std::find(exec.begin(), exec.end(), kOwn) == exec.end()) return false;
  size_t i = 0;
  std::erase_if(v.elements, [&](const Value&) { return exec[i++] == kOwn; });
  return true;
}

// Calls `key` on each key name in the reply `v` of a command whose reply shape is `kind` (kFirstKey:
// [key, ...]; kStreams: [[key, entries], ...] or, in RESP3, {key: entries}); false as soon as
// `key` returns false.
template <typename F>
bool NamedKeys(ReplyRewrite kind, Value& v, F key) {
  if (v.null) return true;
  if (kind == ReplyRewrite::kFirstKey) return v.elements.empty() || key(v.elements[0]);
  if (v.type == '%') {
    for (size_t i = 0; i < v.elements.size(); i += 2) {
      if (!key(v.elements[i])) return false;
    }
    return true;
  }
  for (Value& s : v.elements) {
    if (!s.elements.empty() && !key(s.elements[0])) return false;
  }
  return true;
}

// One rewrite: the tenant, and the strings made on the way (values point into them).
class Editor {
 public:
  Editor(const Tenancy& tenancy, const Tenant& tenant) : tenancy_(tenancy), t_(tenant) {}

  // A key name: strips the prefix; false when it lacks it (the caller removes it).
  bool Key(Value& v) {
    if (v.null) return true;
    if (!IsString(v) || !StartsWith(v.text, t_.prefix)) return false;
    v.text.remove_prefix(t_.prefix.size());
    changed_ = true;
    return true;
  }
  // Every element a key: those without the prefix go.
  void Keys(Value& array) {
    if (!array.null) Keep(array, [&](Value& v) { return Key(v); });
  }
  // Keeps the elements `keep` accepts (after it has rewritten them).
  template <typename F>
  void Keep(Value& array, F keep) {
    const size_t before = array.elements.size();
    std::erase_if(array.elements, [&](Value& v) { return !keep(v); });
    changed_ |= array.elements.size() != before;
  }

  // A channel name as the server sent it; false when it is not the tenant's.
  bool Channel(Value& v) {
    if (!IsString(v)) return true;
    const std::string_view ch = v.text;
    switch (ClassifyChannel(ch)) {
      case ChannelKind::kKeyspace: {
        const size_t head = KeyspaceHeadLength(ch);
        if (!StartsWith(ch.substr(head), t_.prefix)) return false;
        v.text = Own(absl::StrCat(AsAbsl(ch.substr(0, head)), AsAbsl(ch.substr(head + t_.prefix.size()))));
        changed_ = true;
        return true;
      }
      case ChannelKind::kKeyevent:
      case ChannelKind::kInvalidate: return true;
      case ChannelKind::kOrdinary: break;
    }
    if (tenancy_.channels == ChannelMode::kShared) return true;
    if (!StartsWith(ch, t_.prefix)) return false;
    v.text.remove_prefix(t_.prefix.size());
    changed_ = true;
    return true;
  }
  // A message's channel and payload; false when the tenant must not see the message.
  bool Message(Value& channel, Value& payload) {
    if (!IsString(channel)) return true;
    switch (ClassifyChannel(channel.text)) {
      case ChannelKind::kKeyevent: return Key(payload);  // the payload is the key
      case ChannelKind::kInvalidate:
        if (payload.null) return true;  // FLUSHALL: everything is invalid
        Keys(payload);
        return !payload.elements.empty();
      default: return Channel(channel);
    }
  }
  // A pattern as the server sent it back: without the escaped prefix keyguard put in.
  void Pattern(Value& v) {
    if (!IsString(v)) return;
    const std::string_view p = v.text;
    if (const size_t head = KeyspaceHeadLength(p); head != 0) {
      if (StartsWith(p.substr(head), t_.glob_prefix)) {
        v.text = Own(absl::StrCat(AsAbsl(p.substr(0, head)), AsAbsl(p.substr(head + t_.glob_prefix.size()))));
        changed_ = true;
      }
      return;
    }
    if (tenancy_.channels == ChannelMode::kPrefix && StartsWith(p, t_.glob_prefix)) {
      v.text.remove_prefix(t_.glob_prefix.size());
      changed_ = true;
    }
  }
  // Error texts lose the prefix wherever it appears ("No such key 'tenant:a:s'").
  void Error(Value& v) {
    if (v.type != '-' && v.type != '!') return;
    if (v.text.find(t_.prefix) == std::string_view::npos) return;
    std::string s(v.text);
    for (size_t at = s.find(t_.prefix); at != std::string::npos; at = s.find(t_.prefix, at))
      s.erase(at, t_.prefix.size());
    v.text = Own(std::move(s));
    changed_ = true;
  }
  // INFO with only the sections that describe the server, not what other tenants do: Server,
  // Modules and Cluster. Keyspace counts every tenant's keys; Stats (hits, misses, expiries,
  // pub/sub and tracking counts), Commandstats, Errorstats and Latencystats, Clients (blocked and
  // tracking clients), Memory, Persistence and Replication (bytes and writes since the last save,
  // the replication offset) and CPU all move with other tenants' traffic.
  void Info(Value& v) {
    if (!IsString(v)) return;
    static constexpr std::string_view kShared[] = {"Server", "Modules", "Cluster"};
    // A RESP3 verbatim string starts with its format ("txt:"): kept, and the text after it filtered.
    const size_t format = v.type == '=' && v.text.size() >= 4 && v.text[3] == ':' ? 4 : 0;
    const std::string_view text = v.text.substr(format);
    std::string s(v.text.substr(0, format));
    bool keep = false;
    for (size_t pos = 0; pos < text.size();) {
      size_t eol = text.find("\r\n", pos);
      const size_t next = eol == std::string_view::npos ? text.size() : eol + 2;
      const std::string_view line = text.substr(pos, next - pos);
      if (line.starts_with("# ")) {
        const std::string_view name = line.substr(2, line.size() - 2 - (eol == std::string_view::npos ? 0 : 2));
        keep = std::find(std::begin(kShared), std::end(kShared), name) != std::end(kShared);
      }
      if (keep) s.append(line.data(), line.size());
      pos = next;
    }
    while (s.size() >= format + 4 && s.compare(s.size() - 4, 4, "\r\n\r\n") == 0) s.resize(s.size() - 2);
    if (s.size() == v.text.size()) return;
    v.text = Own(std::move(s));
    changed_ = true;
  }

  // Applies `kind` to a command's reply; false when the whole reply must be refused.
  bool Apply(ReplyRewrite kind, Value& v, std::span<const uint8_t> exec) {
    if (v.type == '-' || v.type == '!') {
      Error(v);
      return true;
    }
    switch (kind) {
      case ReplyRewrite::kNone: return true;
      case ReplyRewrite::kKeyArray: Keys(v); return true;
      case ReplyRewrite::kScan:
        if (v.elements.size() == 2) Keys(v.elements[1]);
        return true;
      case ReplyRewrite::kFirstKey:
      case ReplyRewrite::kStreams: return NamedKeys(kind, v, [&](Value& k) { return Key(k); });
      case ReplyRewrite::kBulkKey: return Key(v);
      case ReplyRewrite::kChannelArray: Keep(v, [&](Value& c) { return Channel(c); }); return true;
      case ReplyRewrite::kChannelCounts: {
        std::vector<Value> kept;
        for (size_t i = 0; i + 1 < v.elements.size(); i += 2) {
          if (!Channel(v.elements[i])) {
            changed_ = true;
            continue;
          }
          kept.push_back(std::move(v.elements[i]));
          kept.push_back(std::move(v.elements[i + 1]));
        }
        if (v.type == '%' || kept.size() != v.elements.size()) v.elements = std::move(kept);
        return true;
      }
      case ReplyRewrite::kInfo: Info(v); return true;
      case ReplyRewrite::kTrackingInfo:
        // BCAST prefixes are the tenant's (keyguard adds its prefix to each, and gives BCAST
        // without one the tenant's own, which becomes "" as Redis shows it then).
        for (size_t i = 0; i + 1 < v.elements.size(); i += 2) {
          if (IsString(v.elements[i]) && v.elements[i].text == "prefixes") Keys(v.elements[i + 1]);
        }
        return true;
      case ReplyRewrite::kExec:
        if (v.null) return true;
        // One element per command keyguard saw queued: any other count means the transaction is
        // not the one whose filters keyguard holds.
        if (v.elements.size() != exec.size()) return false;
        for (size_t i = 0; i < v.elements.size(); ++i) {
          const ReplyRewrite k = static_cast<ReplyRewrite>(exec[i]);
          if (k == ReplyRewrite::kExec) return false;
          if (k != ReplyRewrite::kOwn && !Apply(k, v.elements[i], {})) return false;
        }
        changed_ |= DropOwn(v, exec);
        return true;
      case ReplyRewrite::kOwn: return true;
    }
    return true;
  }

  bool changed() const { return changed_; }

 private:
  std::string_view Own(std::string s) { return owned_.emplace_back(std::move(s)); }

  const Tenancy& tenancy_;
  const Tenant& t_;
  std::deque<std::string> owned_;
  bool changed_ = false;
};

bool EqualsAny(std::string_view kind, std::initializer_list<std::string_view> names) {
  for (std::string_view n : names) {
    if (commands::EqualsIgnoreCase(kind, n)) return true;
  }
  return false;
}

}  // namespace

ReplyAction RewriteReply(const Tenancy& tenancy, const Tenant& tenant, ReplyRewrite kind, std::span<const uint8_t> exec,
                         std::string_view frame, std::string* out) {
  const bool error = !frame.empty() && (frame[0] == '-' || frame[0] == '!');
  if (kind == ReplyRewrite::kNone && !error) return ReplyAction::kPass;
  if (error && frame.find(tenant.prefix) == std::string_view::npos) return ReplyAction::kPass;
  std::optional<Value> v = resp::ParseValue(frame);
  Editor editor(tenancy, tenant);
  if (!v || !editor.Apply(kind, *v, exec)) {
    out->assign(kUnconfinable);
    return ReplyAction::kReplace;
  }
  if (!editor.changed()) return ReplyAction::kPass;
  out->clear();
  resp::AppendValue(out, *v);
  return ReplyAction::kReplace;
}

ReplyAction DropOwnElements(std::span<const uint8_t> exec, std::string_view frame, std::string* out) {
  std::optional<Value> v = resp::ParseValue(frame);
  if (!v || v->null || (v->type != '*' && v->type != '~') || v->elements.size() != exec.size()) {
    return ReplyAction::kPass;
  }
  if (!DropOwn(*v, exec)) return ReplyAction::kPass;
  out->clear();
  resp::AppendValue(out, *v);
  return ReplyAction::kReplace;
}

OwnResults OwnElementResults(std::span<const uint8_t> exec, std::string_view frame) {
  OwnResults r;
  std::optional<Value> v = resp::ParseValue(frame);
  if (!v || v->null || (v->type != '*' && v->type != '~') || v->elements.size() != exec.size()) return r;
  for (size_t i = 0; i < exec.size(); ++i) {
    if (exec[i] != static_cast<uint8_t>(ReplyRewrite::kOwn)) continue;
    const Value& e = v->elements[i];
    int64_t n = 0;
    if (e.type == ':' && resp::ParseRedisInt(e.text, &n)) {
      r.moved += n;
    } else if (e.type == '-' || e.type == '!') {
      ++r.errors;
    }
  }
  return r;
}

ReplyAction RenameKeys(ReplyRewrite shape, std::span<const std::pair<std::string, std::string>> names,
                       std::string_view frame, std::string* out) {
  if (frame.starts_with('-')) {
    // An error that quotes a key (NOGROUP No such key 'user:5:profile' ...): the client's name.
    std::string text(frame);
    bool changed = false;
    for (const auto& [to, from] : names) {
      const std::string quoted = absl::StrCat("'", to, "'");
      for (size_t at = text.find(quoted); at != std::string::npos; at = text.find(quoted, at + from.size() + 2)) {
        text.replace(at, quoted.size(), absl::StrCat("'", from, "'"));
        changed = true;
      }
    }
    if (!changed) return ReplyAction::kPass;
    *out = std::move(text);
    return ReplyAction::kReplace;
  }
  if (shape != ReplyRewrite::kFirstKey && shape != ReplyRewrite::kStreams) return ReplyAction::kPass;
  std::optional<Value> v = resp::ParseValue(frame);
  if (!v || v->type == '-' || v->type == '!') return ReplyAction::kPass;
  bool changed = false;
  NamedKeys(shape, *v, [&](Value& k) {
    if (!IsString(k)) return true;
    for (const auto& [to, from] : names) {
      if (k.text == to) {
        k.text = from;
        changed = true;
        break;
      }
    }
    return true;
  });
  if (!changed) return ReplyAction::kPass;
  out->clear();
  resp::AppendValue(out, *v);
  return ReplyAction::kReplace;
}

ReplyAction RewritePush(const Tenancy& tenancy, const Tenant& tenant, std::string_view frame, std::string* out) {
  std::optional<Value> v = resp::ParseValue(frame);
  if (!v) return ReplyAction::kDrop;  // the framer accepted it, so this cannot happen; never leak
  auto& e = v->elements;
  if (e.empty() || !IsString(e[0])) return ReplyAction::kPass;
  const std::string_view kind = e[0].text;
  Editor editor(tenancy, tenant);
  bool keep = true;
  if (EqualsAny(kind, {"message", "smessage"}) && e.size() == 3) {
    keep = editor.Message(e[1], e[2]);
  } else if (EqualsAny(kind, {"pmessage"}) && e.size() == 4) {
    editor.Pattern(e[1]);
    keep = editor.Message(e[2], e[3]);
  } else if (EqualsAny(kind, {"subscribe", "unsubscribe", "ssubscribe", "sunsubscribe"}) && e.size() == 3) {
    editor.Channel(e[1]);  // a confirmation is never dropped: clients count them
  } else if (EqualsAny(kind, {"psubscribe", "punsubscribe"}) && e.size() == 3) {
    editor.Pattern(e[1]);
  } else if (EqualsAny(kind, {"invalidate"}) && e.size() == 2) {
    if (!e[1].null) {
      editor.Keys(e[1]);
      keep = !e[1].elements.empty();
    }
  }
  if (!keep) return ReplyAction::kDrop;
  if (!editor.changed()) return ReplyAction::kPass;
  out->clear();
  resp::AppendValue(out, *v);
  return ReplyAction::kReplace;
}

}  // namespace keyguard::tenant
