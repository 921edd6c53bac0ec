// Key-name policy: rules from the Redis data-modelling guidance (lowercase, colon-separated
// segments, a restricted character set, a leading letter, short keys, no URLs or opaque blobs,
// an entity allow-list, a required prefix) plus user rules (RE2 pattern + rewrite template).
// Compiled once from the config into an immutable snapshot that sessions share read-only.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "keyguard/policy/action.h"
#include "keyguard/commands/command_table.h"

namespace re2 {
class RE2;
}
namespace keyguard::config::v1 {
class KeyPolicy;
}

namespace keyguard::policy {

// The commands a rule applies to.
struct Scope {
  std::vector<commands::CommandId> commands;  // empty: every command
  uint32_t flags = 0;                         // command flags (write, readonly, ...); 0: any
  uint32_t acl = 0;                           // ACL categories; 0: any
  bool Matches(commands::CommandId id, const commands::CommandSpec& spec) const;
};

struct Rule {
  enum class Kind : uint8_t {
    kUser,
    kLowercase,
    kCharset,
    kStartsWithLetter,
    kForbiddenCharacters,
    kHashTags,
    kMaxLength,
    kMaxSegments,
    kOpaqueSegments,
    kEntities,
    kPrefix,
  };
  Kind kind;
  std::string name;  // "lowercase", ..., or the user rule's name
  Action action;
  Scope scope;
  std::shared_ptr<const re2::RE2> pattern;  // kUser
  std::string rewrite;                      // kUser: template with \1..\9
  // kUser with kRewrite: a key stored under the old name is moved to the new one by the first
  // command that names it (LegacyKeys MOVE).
  bool move_legacy = false;
  // kUser with a rewrite that can be reversed (ReverseRule): new name -> old name.
  std::shared_ptr<const re2::RE2> reverse;
  std::string reverse_rewrite;
  // A reversible rule: the pattern's literal text before its first group (every old name starts
  // with it), the template's (every new name starts with it), and a Redis glob every new name
  // matches (the template, each group a '*').
  std::string old_head;
  std::string new_head;
  std::string new_glob;
  // Reversible, action rewrite and no scope: KEYS and SCAN MATCH patterns of old names find the
  // keys it renamed, under their old names (KeyPolicy::PatternRules).
  bool maps_patterns = false;
  // A reversible rule's literal text after its last group, the pattern's and the template's, and
  // how many groups it has: with one, SORT's BY/GET pattern `<old_head>*<old_tail>` takes the new
  // names as `<new_head>*<new_tail>`.
  std::string old_tail;
  std::string new_tail;
  int groups = 0;
  // With move_legacy: a JSON-object string becomes a Hash on the way (reshape: json_to_hash).
  bool json_to_hash = false;
};

// The reverse of a rule's rewrite, when the rule can be reversed: its pattern is literal text and
// capture groups only (anchors allowed; no class escapes, alternation, quantifiers or nested
// groups outside a group), its template uses every group exactly once, and literal text separates
// any two groups in the template. Sets `reverse` (matches new names, groups as in the template) and
// `reverse_rewrite` (builds the old name from them); false otherwise.
bool ReverseRule(std::string_view pattern, std::string_view rewrite, Rule* rule);

// Whether a command may create the key it names at a position with these key-spec flags (a
// name the key policy refuses): keys it overwrites or inserts (OW, INSERT), and keys it updates
// when the command may grow memory (denyoom: INCR, HSET, LPUSH create a missing key; EXPIRE and
// PERSIST do not). Reads, deletes and renames away never create: refusing them would refuse the
// clean-up of an existing bad name.
bool MayCreateKey(uint32_t key_flags, const commands::CommandSpec& spec);

// One broken rule for one key, with the suggested name when the rule has one.
struct Violation {
  const Rule* rule;
  std::string suggestion;
};

class KeyPolicy {
 public:
  // Compiles the config section; errors name the field path (key_policy.rules[1].pattern: ...).
  static absl::StatusOr<std::shared_ptr<const KeyPolicy>> Compile(const config::v1::KeyPolicy& proto);
  // Every built-in rule on `observe`: what runs without a config.
  static std::shared_ptr<const KeyPolicy> Default();

  // Appends the rules `key` breaks under command `id` (resolved to `spec`), user rules first.
  void Check(std::string_view key, commands::CommandId id, const commands::CommandSpec& spec,
             std::vector<Violation>* out) const;
  // True when `key` breaks no rule under any command: the common case, decided by one pass over
  // the key that builds nothing. False does not mean a rule is broken (Check says which).
  bool Conforms(std::string_view key) const { return rules_.empty() || FastPass(Scan(key), key); }

  // `User_1001_Profile` -> `user:1001:profile` (lowercase; `_`, `-`, `.` and CamelCase breaks
  // become `:`).
  static std::string Normalize(std::string_view key);

  const std::vector<Rule>& rules() const { return rules_; }
  // The old name a reversible rewrite rule made `key` from, checked both ways (the old name
  // matches the rule and rewrites to `key`); nullopt when no reversible rule did.
  // `pattern_rules`: only the rules that map patterns (Rule::maps_patterns).
  std::optional<std::string> OldName(std::string_view key, bool pattern_rules = false) const;
  bool has_reversible_rules() const { return has_reversible_; }
  // The name the first rule that maps patterns (Rule::maps_patterns) gives `key`; nullopt when
  // none matches it.
  std::optional<std::string> NewName(std::string_view key) const;
  // Whether some rule maps KEYS and SCAN MATCH patterns (Rule::maps_patterns).
  bool maps_patterns() const { return maps_patterns_; }
  // Scripts and functions (KeyPolicy.scripts): the rule whose action applies to unreviewed ones,
  // and whether a script (its SHA1, lowercase hex) or a function (its name) was reviewed.
  const Rule& scripts_rule() const { return scripts_; }
  bool ScriptReviewed(std::string_view sha1) const { return allowed_scripts_.contains(std::string(sha1)); }
  size_t reviewed_scripts() const { return allowed_scripts_.size(); }
  size_t reviewed_functions() const { return allowed_functions_.size(); }
  bool FunctionReviewed(std::string_view name) const { return allowed_functions_.contains(std::string(name)); }
  size_t max_key_patterns() const { return max_key_patterns_; }
  bool empty() const { return rules_.empty(); }

 private:
  void BuildClasses();
  enum : uint8_t { kUpper = 1, kBad = 2, kForbidden = 4, kBrace = 8, kColon = 16, kLetter = 32 };
  // What the built-in rules look at, from one pass over a key.
  struct Shape {
    uint8_t seen = 0;  // the union of its bytes' classes
    size_t segments = 1;
    bool letter_first = false;  // after a leading '{' where hash tags are allowed
  };
  Shape Scan(std::string_view key) const;
  // Whether a segment is longer than max_segment_bytes_.
  bool LongSegment(std::string_view key) const;
  // Shape alone says no rule can be broken: only shape rules, and the key is within all of them.
  bool FastPass(const Shape& shape, std::string_view key) const;

  std::vector<Rule> rules_;
  Rule scripts_{Rule::Kind::kUser,
                "scripts",
                Action::kObserve,
                {},
                nullptr,
                "",
                false,
                nullptr,
                "",
                "",
                "",
                "",
                false,
                "",
                "",
                0,
                false};
  absl::flat_hash_set<std::string> allowed_scripts_, allowed_functions_;
  bool punctuation_[256] = {};
  uint8_t class_[256] = {};  // character classes per byte, from punctuation_
  bool slash_allowed_ = false;
  bool has_key_list_rules_ = false;  // user, entity or prefix rules: no fast path
  bool has_reversible_ = false;
  bool maps_patterns_ = false;
  bool allow_hash_tags_ = true;
  bool normalize_ = true;
  uint32_t max_length_ = 128;
  uint32_t max_segments_ = 8;
  uint32_t max_segment_bytes_ = 64;
  std::vector<std::string> entities_;
  std::string prefix_;
  size_t max_key_patterns_ = 500;
};

}  // namespace keyguard::policy
