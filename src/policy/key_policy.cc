#include "keyguard/common/field_error.h"
#include "keyguard/policy/key_policy.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "keyguard/common/views.h"
#include "keyguard/config/v1/config.pb.h"
#include "re2/re2.h"

namespace keyguard::policy {
namespace {

namespace pb = keyguard::config::v1;

Action ToAction(pb::Action a, Action fallback) {
  switch (a) {
    case pb::OBSERVE: return Action::kObserve;
    case pb::WARN: return Action::kWarn;
    case pb::REWRITE: return Action::kRewrite;
    case pb::REJECT: return Action::kReject;
    default: return fallback;
  }
}

absl::StatusOr<Scope> CompileScope(const pb::Scope& s, const std::string& path) {
  Scope scope;
  for (int i = 0; i < s.commands_size(); ++i) {
    const commands::CommandId id = commands::LookupCommand(s.commands(i));
    if (id == commands::kUnknownCommand) {
      return FieldError(absl::StrCat(path, ".commands[", i, "]"),
                        absl::StrCat("'", s.commands(i), "' is not a Redis command"));
    }
    scope.commands.push_back(id);
  }
  for (int i = 0; i < s.categories_size(); ++i) {
    const uint32_t flag = commands::CommandFlagMask(s.categories(i));
    const uint32_t acl = commands::AclCategoryMask(s.categories(i));
    if (flag == 0 && acl == 0) {
      return FieldError(absl::StrCat(path, ".categories[", i, "]"),
                        absl::StrCat("'", s.categories(i), "' is neither a command flag nor an ACL category"));
    }
    // A name that is both (e.g. "write") selects by the command flag.
    if (flag != 0) {
      scope.flags |= flag;
    } else {
      scope.acl |= acl;
    }
  }
  return scope;
}

bool IsLetter(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsDigit(unsigned char c) { return c >= '0' && c <= '9'; }
bool IsForbidden(unsigned char c) {
  switch (c) {
    case ' ':
    case '"':
    case '\'':
    case '\\':
    case '*':
    case '?':
    case '[':
    case ']':
    case '(':
    case ')': return true;
    default: return c < 0x20 || c == 0x7f;
  }
}

// Braces form exactly one non-empty `{tag}` with nothing nested.
bool WellFormedHashTag(std::string_view key) {
  const size_t open = key.find('{');
  const size_t close = key.find('}');
  if (open == std::string_view::npos || close == std::string_view::npos || close < open + 2) return false;
  return key.find('{', open + 1) == std::string_view::npos && key.find('}', close + 1) == std::string_view::npos;
}

}  // namespace

bool ReverseRule(std::string_view pattern, std::string_view rewrite, Rule* rule) {
  // The pattern: literal pieces and the text of each capture group, in order.
  std::string_view p = pattern;
  if (p.starts_with('^')) p.remove_prefix(1);
  if (p.ends_with('$') && !p.ends_with("\\$")) p.remove_suffix(1);
  std::vector<std::string> literals(1);  // literals[i] comes before group i (1-based), the last after all
  std::vector<std::string_view> groups;
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 1 >= p.size() || std::isalnum(static_cast<unsigned char>(p[i + 1]))) return false;  // \d, \b, ...
      literals.back().push_back(p[i + 1]);
      i += 2;
    } else if (c == '(') {
      if (i + 1 < p.size() && p[i + 1] == '?') return false;
      size_t j = i + 1;
      bool in_class = false;
      for (; j < p.size(); ++j) {
        if (p[j] == '\\') {
          ++j;
        } else if (in_class) {
          in_class = p[j] != ']';
        } else if (p[j] == '[') {
          in_class = true;
        } else if (p[j] == '(') {
          return false;  // a nested group renumbers the rest
        } else if (p[j] == ')') {
          break;
        }
      }
      if (j >= p.size()) return false;
      groups.push_back(p.substr(i + 1, j - i - 1));
      literals.emplace_back();
      i = j + 1;
    } else if (std::string_view(".*+?[]{}|)^$").find(c) != std::string_view::npos) {
      return false;
    } else {
      literals.back().push_back(c);
      ++i;
    }
  }
  // The template (RE2's form, \1..\9): each group once, literal text between two groups.
  std::string forward = "^";
  std::string glob;  // the template as a Redis glob, each group a '*'
  auto glob_literal = [&glob](std::string_view text) {
    for (char ch : text) {
      if (std::string_view("*?[]\\").find(ch) != std::string_view::npos) glob.push_back('\\');
      glob.push_back(ch);
    }
  };
  std::vector<int> order;  // group numbers in template order
  std::string piece;
  bool last_was_group = false;
  for (size_t i = 0; i < rewrite.size(); ++i) {
    if (rewrite[i] == '\\' && i + 1 < rewrite.size() && IsDigit(rewrite[i + 1])) {
      const int g = rewrite[i + 1] - '0';
      if (g < 1 || g > static_cast<int>(groups.size())) return false;
      if (std::find(order.begin(), order.end(), g) != order.end()) return false;
      if (last_was_group && piece.empty()) return false;
      forward += re2::RE2::QuoteMeta(piece);
      if (order.empty()) rule->new_head = piece;
      glob_literal(piece);
      glob.push_back('*');
      piece.clear();
      absl::StrAppend(&forward, "(", AsAbsl(groups[g - 1]), ")");
      order.push_back(g);
      last_was_group = true;
      ++i;
    } else if (rewrite[i] == '\\' && i + 1 < rewrite.size()) {
      piece.push_back(rewrite[++i]);
    } else {
      piece.push_back(rewrite[i]);
    }
  }
  forward += re2::RE2::QuoteMeta(piece) + "$";
  glob_literal(piece);
  if (order.size() != groups.size()) return false;
  auto re = std::make_shared<re2::RE2>(forward, re2::RE2::Quiet);
  if (!re->ok() || re->NumberOfCapturingGroups() != static_cast<int>(groups.size())) return false;
  // The old name: the pattern's literals around the groups, each group from its place in the template.
  std::string back;
  auto literal = [&](const std::string& text) {
    for (char ch : text) {
      if (ch == '\\') back.push_back('\\');
      back.push_back(ch);
    }
  };
  for (size_t g = 0; g < groups.size(); ++g) {
    literal(literals[g]);
    const auto at = std::find(order.begin(), order.end(), static_cast<int>(g + 1)) - order.begin();
    absl::StrAppend(&back, "\\", at + 1);
  }
  literal(literals.back());
  rule->reverse = std::move(re);
  rule->reverse_rewrite = std::move(back);
  rule->old_head = literals[0];
  rule->old_tail = literals.back();
  rule->new_tail = piece;
  rule->groups = static_cast<int>(groups.size());
  rule->new_glob = std::move(glob);
  return true;
}

std::optional<std::string> KeyPolicy::OldName(std::string_view key, bool pattern_rules) const {
  if (!has_reversible_) return std::nullopt;
  const re2::StringPiece k(key.data(), key.size());
  for (const Rule& r : rules_) {
    if (r.reverse == nullptr || (pattern_rules && !r.maps_patterns) || !re2::RE2::FullMatch(k, *r.reverse)) continue;
    std::string old, again;
    if (!re2::RE2::Extract(k, *r.reverse, r.reverse_rewrite, &old)) continue;
    if (!re2::RE2::Extract(old, *r.pattern, r.rewrite, &again) || !re2::RE2::FullMatch(old, *r.pattern) ||
        again != key) {
      continue;
    }
    return old;
  }
  return std::nullopt;
}

std::optional<std::string> KeyPolicy::NewName(std::string_view key) const {
  if (!maps_patterns_) return std::nullopt;
  const re2::StringPiece k(key.data(), key.size());
  for (const Rule& r : rules_) {
    std::string out;
    if (r.maps_patterns && re2::RE2::FullMatch(k, *r.pattern) && re2::RE2::Extract(k, *r.pattern, r.rewrite, &out)) {
      return out;
    }
  }
  return std::nullopt;
}

bool MayCreateKey(uint32_t key_flags, const commands::CommandSpec& spec) {
  if (key_flags & (commands::kKeyOw | commands::kKeyInsert)) return true;
  if (key_flags & (commands::kKeyRo | commands::kKeyRm | commands::kKeyDelete)) return false;
  static const uint32_t kDenyOom = commands::CommandFlagMask("denyoom");
  return (key_flags & commands::kKeyRw) != 0 && (spec.flags & kDenyOom) != 0;
}

bool Scope::Matches(commands::CommandId id, const commands::CommandSpec& spec) const {
  if (!commands.empty() && std::find(commands.begin(), commands.end(), id) == commands.end()) return false;
  if ((flags | acl) != 0 && (spec.flags & flags) == 0 && (spec.acl & acl) == 0) return false;
  return true;
}

std::string KeyPolicy::Normalize(std::string_view key) {
  std::string out;
  out.reserve(key.size() + 4);
  auto separator = [&] {
    if (!out.empty() && out.back() != ':') out.push_back(':');
  };
  for (size_t i = 0; i < key.size(); ++i) {
    const unsigned char c = key[i];
    if (c == '_' || c == '-' || c == '.' || c == ':') {
      separator();
      continue;
    }
    // A CamelCase break: lower or digit followed by upper ("userProfile", "v2Beta").
    if (c >= 'A' && c <= 'Z' && i > 0) {
      const unsigned char p = key[i - 1];
      if ((p >= 'a' && p <= 'z') || IsDigit(p)) separator();
    }
    out.push_back(static_cast<char>(absl::ascii_tolower(c)));
  }
  while (!out.empty() && out.back() == ':') out.pop_back();
  return out;
}

std::shared_ptr<const KeyPolicy> KeyPolicy::Default() {
  static const std::shared_ptr<const KeyPolicy> policy = *Compile(pb::KeyPolicy());
  return policy;
}

absl::StatusOr<std::shared_ptr<const KeyPolicy>> KeyPolicy::Compile(const pb::KeyPolicy& p) {
  auto policy = std::make_shared<KeyPolicy>();
  if (p.has_enabled() && !p.enabled()) return std::shared_ptr<const KeyPolicy>(std::move(policy));  // no rules
  const Action fallback = ToAction(p.default_action(), Action::kObserve);
  const std::string punctuation = p.has_allowed_punctuation() ? p.allowed_punctuation() : ":._-|";
  for (unsigned char c : punctuation) {
    if (IsLetter(c) || IsDigit(c) || IsForbidden(c)) {
      return FieldError("key_policy.allowed_punctuation",
                        absl::StrCat("'", std::string(1, c), "' cannot be punctuation"));
    }
    policy->punctuation_[c] = true;
  }
  policy->allow_hash_tags_ = !p.has_allow_hash_tags() || p.allow_hash_tags();
  policy->normalize_ = !p.has_normalize_separators() || p.normalize_separators();
  if (p.has_max_length_bytes()) policy->max_length_ = p.max_length_bytes();
  if (p.has_max_segment_count()) policy->max_segments_ = p.max_segment_count();
  if (p.has_max_segment_bytes()) policy->max_segment_bytes_ = p.max_segment_bytes();
  if (p.has_max_key_patterns()) policy->max_key_patterns_ = p.max_key_patterns();
  for (const std::string& e : p.entities()) policy->entities_.push_back(e);
  policy->prefix_ = p.required_prefix();

  // User rules come first: they name the fix the platform team wants.
  for (int i = 0; i < p.rules_size(); ++i) {
    const pb::UserRule& u = p.rules(i);
    const std::string path = absl::StrCat("key_policy.rules[", i, "]");
    if (u.name().empty()) return FieldError(path + ".name", "required");
    for (const Rule& r : policy->rules_) {
      if (r.name == u.name()) return FieldError(path + ".name", absl::StrCat("'", u.name(), "' is used twice"));
    }
    if (u.pattern().empty()) return FieldError(path + ".pattern", "required");
    auto re = std::make_shared<re2::RE2>(u.pattern(), re2::RE2::Quiet);
    if (!re->ok()) return FieldError(path + ".pattern", re->error());
    Rule rule{Rule::Kind::kUser, u.name(), ToAction(u.action(), fallback), {}, re, "", false, nullptr, ""};
    // The template uses $1..$9; RE2 rewrites with \1..\9.
    for (size_t j = 0; j < u.rewrite().size(); ++j) {
      const char c = u.rewrite()[j];
      if (c == '$' && j + 1 < u.rewrite().size() && IsDigit(u.rewrite()[j + 1])) {
        rule.rewrite.push_back('\\');  // $1 -> \1
        continue;
      }
      if (c == '\\') rule.rewrite.push_back('\\');  // a literal backslash
      rule.rewrite.push_back(c);
    }
    std::string why;
    if (!rule.rewrite.empty() && !re->CheckRewriteString(rule.rewrite, &why)) return FieldError(path + ".rewrite", why);
    if (rule.action == Action::kRewrite && rule.rewrite.empty()) {
      return FieldError(path + ".rewrite", "required when the action is rewrite");
    }
    rule.move_legacy = rule.action == Action::kRewrite && u.legacy_keys() != pb::LEAVE;
    if (u.reshape() == pb::JSON_TO_HASH) {
      if (!rule.move_legacy) {
        return FieldError(path + ".reshape", "json_to_hash applies to a rewrite rule that moves legacy keys");
      }
      rule.json_to_hash = true;
    }
    if (!rule.rewrite.empty() && ReverseRule(u.pattern(), rule.rewrite, &rule)) policy->has_reversible_ = true;
    auto scope = CompileScope(u.scope(), path + ".scope");
    if (!scope.ok()) return scope.status();
    rule.scope = *std::move(scope);
    if (!rule.scope.commands.empty() || rule.scope.flags != 0 || rule.scope.acl != 0) {
      // A scoped rule sends only some commands to the new name: a move by one of them would hide
      // the key from the others. Scoped rules leave old keys where they are.
      if (rule.move_legacy && u.legacy_keys() == pb::MOVE) {
        return FieldError(path + ".legacy_keys",
                          "move needs a rule without a scope (a scoped rule sends only some commands to the new "
                          "name, and a move by one of them would hide the key from the others)");
      }
      if (rule.json_to_hash) {
        return FieldError(path + ".reshape",
                          "json_to_hash needs a rule without a scope (a scoped rule leaves old keys)");
      }
      rule.move_legacy = false;
    } else if (rule.reverse != nullptr && rule.action == Action::kRewrite) {
      rule.maps_patterns = true;
      policy->maps_patterns_ = true;
    }
    policy->rules_.push_back(std::move(rule));
  }

  struct Builtin {
    Rule::Kind kind;
    const char* name;
    const pb::Rule& config;
    bool applies;
  };
  const Builtin builtins[] = {
      {Rule::Kind::kLowercase, "lowercase", p.lowercase(), true},
      {Rule::Kind::kCharset, "charset", p.charset(), true},
      {Rule::Kind::kStartsWithLetter, "starts_with_letter", p.starts_with_letter(), true},
      {Rule::Kind::kForbiddenCharacters, "forbidden_characters", p.forbidden_characters(), true},
      {Rule::Kind::kHashTags, "hash_tags", p.hash_tags(), true},
      {Rule::Kind::kMaxLength, "max_length", p.max_length(), true},
      {Rule::Kind::kMaxSegments, "max_segments", p.max_segments(), true},
      {Rule::Kind::kOpaqueSegments, "no_opaque_segments", p.no_opaque_segments(), true},
      {Rule::Kind::kEntities, "entity_allow_list", p.entity_allow_list(), !p.entities().empty()},
      {Rule::Kind::kPrefix, "prefix", p.prefix(), !p.required_prefix().empty()},
  };
  for (const Builtin& b : builtins) {
    if (!b.applies || (b.config.has_enabled() && !b.config.enabled())) continue;
    auto scope = CompileScope(b.config.scope(), absl::StrCat("key_policy.", b.name, ".scope"));
    if (!scope.ok()) return scope.status();
    Action action = ToAction(b.config.action(), fallback);
    policy->rules_.push_back(
        Rule{b.kind, b.name, action, *std::move(scope), nullptr, "", false, nullptr, "", "", "", "", false});
  }
  policy->scripts_.action = ToAction(p.scripts().action(), fallback);
  for (int i = 0; i < p.scripts().allowed_scripts_size(); ++i) {
    const std::string sha = absl::AsciiStrToLower(p.scripts().allowed_scripts(i));
    if (sha.size() != 40 || sha.find_first_not_of("0123456789abcdef") != std::string::npos) {
      return FieldError(absl::StrCat("key_policy.scripts.allowed_scripts[", i, "]"),
                        "must be 40 hex digits (the SHA1 SCRIPT LOAD answers)");
    }
    policy->allowed_scripts_.insert(sha);
  }
  for (const std::string& f : p.scripts().allowed_functions()) policy->allowed_functions_.insert(f);
  policy->BuildClasses();
  return std::shared_ptr<const KeyPolicy>(std::move(policy));
}

void KeyPolicy::BuildClasses() {
  for (int c = 0; c < 256; ++c) {
    uint8_t cls = 0;
    if (IsLetter(c)) cls |= kLetter;
    if (c >= 'A' && c <= 'Z') cls |= kUpper;
    if (c == ':') cls |= kColon;
    if (c == '{' || c == '}') {
      cls |= kBrace;
    } else if (!IsLetter(c) && !IsDigit(c) && !punctuation_[c]) {
      cls |= kBad;
    }
    if (IsForbidden(static_cast<unsigned char>(c))) cls |= kForbidden;
    class_[c] = cls;
  }
  slash_allowed_ = punctuation_[static_cast<unsigned char>('/')];
  has_key_list_rules_ = false;
  for (const Rule& r : rules_) {
    has_key_list_rules_ |=
        r.kind == Rule::Kind::kUser || r.kind == Rule::Kind::kEntities || r.kind == Rule::Kind::kPrefix;
  }
}

KeyPolicy::Shape KeyPolicy::Scan(std::string_view key) const {
  // One table lookup per byte; four bytes a round, as keys are a few dozen bytes.
  const auto* p = reinterpret_cast<const unsigned char*>(key.data());
  const size_t n = key.size();
  uint8_t seen = 0;
  size_t colons = 0;  // kColon per ':'
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint8_t a = class_[p[i]], b = class_[p[i + 1]], c = class_[p[i + 2]], d = class_[p[i + 3]];
    seen |= a | b | c | d;
    colons += (a & kColon) + (b & kColon) + (c & kColon) + (d & kColon);
  }
  for (; i < n; ++i) {
    const uint8_t a = class_[p[i]];
    seen |= a;
    colons += a & kColon;
  }
  Shape shape;
  shape.seen = seen;
  shape.segments = 1 + colons / kColon;
  // A leading hash tag is allowed where tags are: `{user:1001}:profile` starts with its tag's letter.
  const size_t first = allow_hash_tags_ && n > 0 && p[0] == '{' ? 1 : 0;
  shape.letter_first = n > first && (class_[p[first]] & kLetter);
  return shape;
}

bool KeyPolicy::LongSegment(std::string_view key) const {
  if (key.size() <= max_segment_bytes_) return false;  // no segment is longer than the key
  size_t start = 0;
  for (;;) {
    const size_t colon = key.find(':', start);
    const size_t end = colon == std::string_view::npos ? key.size() : colon;
    if (end - start > max_segment_bytes_) return true;
    if (colon == std::string_view::npos) return false;
    start = colon + 1;
  }
}

bool KeyPolicy::FastPass(const Shape& shape, std::string_view key) const {
  return !has_key_list_rules_ && (shape.seen & (kUpper | kBad | kBrace)) == 0 && shape.letter_first &&
         key.size() <= max_length_ && shape.segments <= max_segments_ && !LongSegment(key) &&
         (!slash_allowed_ || key.find("://") == std::string_view::npos);
}

void KeyPolicy::Check(std::string_view key, commands::CommandId id, const commands::CommandSpec& spec,
                      std::vector<Violation>* out) const {
  const Shape shape = Scan(key);
  // The common case: a conforming key and only built-in rules that look at its shape.
  if (FastPass(shape, key)) return;
  const bool upper = shape.seen & kUpper;
  const bool bad_char = shape.seen & kBad;
  const bool forbidden = shape.seen & kForbidden;
  const bool braces = shape.seen & kBrace;
  const bool letter_first = shape.letter_first;
  const size_t segments = shape.segments;

  for (const Rule& rule : rules_) {
    if (!rule.scope.Matches(id, spec)) continue;
    bool broken = false;
    std::string suggestion;
    switch (rule.kind) {
      case Rule::Kind::kUser:
        if (re2::RE2::FullMatch(key, *rule.pattern)) {
          broken = true;
          if (!rule.rewrite.empty()) re2::RE2::Extract(key, *rule.pattern, rule.rewrite, &suggestion);
        }
        break;
      case Rule::Kind::kLowercase:
        broken = upper;
        if (broken) suggestion = normalize_ ? Normalize(key) : absl::AsciiStrToLower(std::string(key));
        break;
      case Rule::Kind::kCharset:
        broken = bad_char || (braces && !allow_hash_tags_);
        if (broken && normalize_) {
          std::string n = Normalize(key);
          bool clean = true;
          for (unsigned char c : n) clean &= IsLetter(c) || IsDigit(c) || punctuation_[c];
          if (clean && !n.empty()) suggestion = std::move(n);
        }
        break;
      case Rule::Kind::kStartsWithLetter: broken = !letter_first; break;
      case Rule::Kind::kForbiddenCharacters: broken = forbidden; break;
      case Rule::Kind::kHashTags: broken = braces && (!allow_hash_tags_ || !WellFormedHashTag(key)); break;
      case Rule::Kind::kMaxLength: broken = key.size() > max_length_; break;
      case Rule::Kind::kMaxSegments: broken = segments > max_segments_; break;
      case Rule::Kind::kOpaqueSegments: broken = LongSegment(key) || key.find("://") != std::string_view::npos; break;
      case Rule::Kind::kEntities: {
        const std::string_view entity = key.substr(0, key.find(':'));
        broken = std::find(entities_.begin(), entities_.end(), entity) == entities_.end();
        break;
      }
      case Rule::Kind::kPrefix: broken = key.substr(0, prefix_.size()) != prefix_; break;
    }
    if (broken) out->push_back(Violation{&rule, std::move(suggestion)});
  }
}

}  // namespace keyguard::policy
