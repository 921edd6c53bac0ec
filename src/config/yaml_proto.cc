#include "config/yaml_proto.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <type_traits>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "yaml-cpp/anchor.h"
#include "yaml-cpp/depthguard.h"
#include "yaml-cpp/eventhandler.h"

namespace keyguard::config {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::EnumValueDescriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

absl::Status Error(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path.empty() ? "(top level)" : path, ": ", what));
}

std::string Join(const std::string& path, const std::string& key) { return path.empty() ? key : path + "." + key; }

// A value quoted in an error: long ones cut, so that a 4 MiB scalar does not make a 4 MiB message.
std::string Shown(const std::string& s) {
  constexpr size_t kMax = 64;
  return s.size() <= kMax ? s : absl::StrCat(s.substr(0, kMax), "...");
}

std::string Where(const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  return m.is_null() ? "" : absl::StrCat(" (line ", m.line + 1, ", column ", m.column + 1, ")");
}

const char* KindOf(const YAML::Node& n) {
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  if (n.IsNull()) return "null";
  return "a scalar";
}

// What a walk may still spend: aliases let a small text stand for a huge tree.
struct Budget {
  int64_t values = kMaxExpandedValues;
  int64_t scalar_bytes = kMaxExpandedScalarBytes;
};

// Charges one node to the budget and checks what every node must satisfy: the depth, and no
// explicit tag ("!" is what yaml-cpp gives a quoted scalar, "?" a plain one).
absl::Status Enter(const YAML::Node& n, const std::string& path, int depth, Budget* b) {
  if (depth > kMaxYamlDepth) return Error(path, absl::StrCat("nested deeper than ", kMaxYamlDepth, " levels"));
  if (--b->values < 0) {
    return Error(path,
                 absl::StrCat("the document expands (through aliases) to more than ", kMaxExpandedValues, " values"));
  }
  if (n.IsScalar()) {
    b->scalar_bytes -= static_cast<int64_t>(n.Scalar().size());
    if (b->scalar_bytes < 0) {
      return Error(path, absl::StrCat("the document expands (through aliases) to more than ", kMaxExpandedScalarBytes,
                                      " bytes of text"));
    }
  }
  const std::string& tag = n.Tag();
  if (!tag.empty() && tag != "?" && tag != "!") {
    constexpr std::string_view kCore = "tag:yaml.org,2002:";
    const std::string shown = tag.rfind(kCore, 0) == 0 ? absl::StrCat("!!", tag.substr(kCore.size())) : tag;
    return Error(path, absl::StrCat("tags are not supported (", Shown(shown), "); write the plain value"));
  }
  return absl::OkStatus();
}

absl::Status ToMessage(const YAML::Node& node, Message* message, const std::string& path, int depth, Budget* b);

bool LooksLikeInteger(std::string_view s) {
  size_t i = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;
  if (i == s.size()) return false;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
  }
  return true;
}

// Decimal integers only (YAML's 0x1f and 0o17 are not taken); anything outside T's range is an
// error naming the range, never a wrapped value.
template <typename T>
absl::Status ParseInt(const YAML::Node& n, const std::string& path, T* out) {
  const std::string& s = n.Scalar();
  if (!LooksLikeInteger(s)) return Error(path, "expected an integer");
  const auto out_of_range = [&] {
    return Error(
        path, absl::StrCat("must be between ", std::numeric_limits<T>::min(), " and ", std::numeric_limits<T>::max()));
  };
  if constexpr (std::is_signed_v<T>) {
    int64_t v;
    if (!absl::SimpleAtoi(s, &v) || v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
      return out_of_range();
    }
    *out = static_cast<T>(v);
  } else {
    uint64_t v;
    if (s[0] == '-') {
      if (s.find_first_not_of("0", 1) != std::string::npos) return out_of_range();
      v = 0;  // -0
    } else if (!absl::SimpleAtoi(s, &v) || v > std::numeric_limits<T>::max()) {
      return out_of_range();
    }
    *out = static_cast<T>(v);
  }
  return absl::OkStatus();
}

// One value of field `f` (an element when `f` is repeated).
absl::Status SetValue(const YAML::Node& n, Message* m, const FieldDescriptor* f, const std::string& path, int depth,
                      Budget* b) {
  const Reflection* r = m->GetReflection();
  const bool rep = f->is_repeated();
  if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    Message* child = rep ? r->AddMessage(m, f) : r->MutableMessage(m, f);
    return ToMessage(n, child, path, depth, b);
  }
  if (auto s = Enter(n, path, depth, b); !s.ok()) return s;
  if (!n.IsScalar()) {
    return Error(path,
                 f->cpp_type() == FieldDescriptor::CPPTYPE_STRING ? "expected a string" : "expected a scalar value");
  }
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_STRING:
      rep ? r->AddString(m, f, n.Scalar()) : r->SetString(m, f, n.Scalar());
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_BOOL: {
      const std::string s = absl::AsciiStrToLower(n.Scalar());
      bool v;
      if (s == "true" || s == "yes" || s == "on") {
        v = true;
      } else if (s == "false" || s == "no" || s == "off") {
        v = false;
      } else {
        return Error(path, "expected true or false");
      }
      rep ? r->AddBool(m, f, v) : r->SetBool(m, f, v);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_INT32: {
      int32_t v = 0;
      if (auto s = ParseInt(n, path, &v); !s.ok()) return s;
      rep ? r->AddInt32(m, f, v) : r->SetInt32(m, f, v);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_INT64: {
      int64_t v = 0;
      if (auto s = ParseInt(n, path, &v); !s.ok()) return s;
      rep ? r->AddInt64(m, f, v) : r->SetInt64(m, f, v);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_UINT32: {
      uint32_t v = 0;
      if (auto s = ParseInt(n, path, &v); !s.ok()) return s;
      rep ? r->AddUInt32(m, f, v) : r->SetUInt32(m, f, v);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_UINT64: {
      uint64_t v = 0;
      if (auto s = ParseInt(n, path, &v); !s.ok()) return s;
      rep ? r->AddUInt64(m, f, v) : r->SetUInt64(m, f, v);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_DOUBLE:
    case FieldDescriptor::CPPTYPE_FLOAT: {
      double v;
      if (!absl::SimpleAtod(n.Scalar(), &v)) return Error(path, "expected a number");
      if (!std::isfinite(v)) return Error(path, "must be a finite number");
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_DOUBLE) {
        rep ? r->AddDouble(m, f, v) : r->SetDouble(m, f, v);
      } else {
        constexpr double kMax = std::numeric_limits<float>::max();
        if (v < -kMax || v > kMax) return Error(path, absl::StrCat("must be between ", -kMax, " and ", kMax));
        rep ? r->AddFloat(m, f, static_cast<float>(v)) : r->SetFloat(m, f, static_cast<float>(v));
      }
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_ENUM: {
      const auto* e = f->enum_type();
      std::vector<std::string> names;
      for (int i = 0; i < e->value_count(); ++i) {
        const EnumValueDescriptor* v = e->value(i);
        if (v->number() == 0) continue;  // *_UNSPECIFIED is not written by users
        const std::string name = absl::AsciiStrToLower(v->name());
        if (name == absl::AsciiStrToLower(n.Scalar())) {
          rep ? r->AddEnum(m, f, v) : r->SetEnum(m, f, v);
          return absl::OkStatus();
        }
        names.push_back(name);
      }
      return Error(path, absl::StrCat("'", Shown(n.Scalar()), "' is not one of ", absl::StrJoin(names, ", ")));
    }
    case FieldDescriptor::CPPTYPE_MESSAGE: break;  // handled above
  }
  return Error(path, "unsupported field type");
}

absl::Status ToMessage(const YAML::Node& node, Message* message, const std::string& path, int depth, Budget* b) {
  if (!node) return absl::OkStatus();
  if (auto s = Enter(node, path, depth, b); !s.ok()) return s;
  if (node.IsNull()) return absl::OkStatus();
  if (!node.IsMap()) return Error(path, "expected a mapping");
  const Descriptor* d = message->GetDescriptor();
  std::map<std::string, int> seen;  // key -> its line, for duplicates
  for (const auto& kv : node) {
    const YAML::Node& k = kv.first;
    if (auto s = Enter(k, path, depth + 1, b); !s.ok()) return s;
    if (!k.IsScalar()) {
      return Error(path, absl::StrCat("a key must be a field name, not ", KindOf(k), Where(k)));
    }
    const std::string& key = k.Scalar();
    const std::string field_path = Join(path, Shown(key));
    // yaml-cpp does not implement merge keys: it would hand us "<<" as a field name.
    if (key == "<<" && k.Tag() == "?") {
      return Error(field_path,
                   "merge keys are not supported; write the fields out (an alias may stand for a whole "
                   "value, as in `rules: *shared_rules`)");
    }
    const int line = k.Mark().is_null() ? 0 : k.Mark().line + 1;
    if (auto [it, fresh] = seen.emplace(key, line); !fresh) {
      return Error(field_path, absl::StrCat("duplicate key (first at line ", it->second, ")"));
    }
    const FieldDescriptor* f = d->FindFieldByName(key);
    if (f == nullptr) {
      std::set<std::string> known;
      for (int i = 0; i < d->field_count(); ++i) known.insert(d->field(i)->name());
      return Error(field_path, absl::StrCat("unknown field (known: ", absl::StrJoin(known, ", "), ")"));
    }
    const YAML::Node& value = kv.second;
    if (f->is_repeated()) {
      if (auto s = Enter(value, field_path, depth + 1, b); !s.ok()) return s;
      if (value.IsNull()) continue;
      if (!value.IsSequence()) return Error(field_path, "expected a list");
      for (size_t i = 0; i < value.size(); ++i) {
        if (auto s = SetValue(value[i], message, f, absl::StrCat(field_path, "[", i, "]"), depth + 2, b); !s.ok()) {
          return s;
        }
      }
      continue;
    }
    if (auto s = SetValue(value, message, f, field_path, depth + 1, b); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::string Position(int line, int column) { return absl::StrCat("line ", line, ", column ", column, ": "); }

// YAML text is printable Unicode in UTF-8 (YAML 1.2, 5.1): tab, LF and CR are the only C0
// controls; DEL, the C1 controls but NEL, U+FFFE and U+FFFF are out too. A control character in a
// value is written as an escape in a double-quoted string ("\x0b"). yaml-cpp itself misreads a
// NUL and passes invalid UTF-8 through, so this runs first.
absl::Status CheckText(std::string_view t) {
  size_t i = t.substr(0, 3) == "\xEF\xBB\xBF" ? 3 : 0;  // a byte order mark
  int line = 1;
  int column = 1;
  while (i < t.size()) {
    const unsigned char c = static_cast<unsigned char>(t[i]);
    if (c < 0x80) {
      if (c == '\n') {
        ++line;
        column = 1;
      } else if ((c < 0x20 && c != '\t' && c != '\r') || c == 0x7f) {
        return absl::InvalidArgumentError(
            absl::StrCat(Position(line, column), "control character 0x", absl::Hex(c, absl::kZeroPad2),
                         " is not allowed in YAML text (in a double-quoted string write it as \\x",
                         absl::Hex(c, absl::kZeroPad2), ")"));
      } else {
        ++column;
      }
      ++i;
      continue;
    }
    size_t len = 0;
    uint32_t cp = 0, least = 0;
    if ((c & 0xe0) == 0xc0) {
      len = 2, cp = c & 0x1f, least = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3, cp = c & 0x0f, least = 0x800;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4, cp = c & 0x07, least = 0x10000;
    }
    bool valid = len != 0 && i + len <= t.size();
    for (size_t k = 1; valid && k < len; ++k) {
      const unsigned char cc = static_cast<unsigned char>(t[i + k]);
      valid = (cc & 0xc0) == 0x80;
      cp = (cp << 6) | (cc & 0x3f);
    }
    if (!valid || cp < least || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
      return absl::InvalidArgumentError(
          absl::StrCat(Position(line, column), "invalid UTF-8 (byte 0x", absl::Hex(c, absl::kZeroPad2), ")"));
    }
    if ((cp <= 0x9f && cp != 0x85) || cp == 0xfffe || cp == 0xffff) {
      return absl::InvalidArgumentError(absl::StrCat(Position(line, column), "control character U+",
                                                     absl::Hex(cp, absl::kZeroPad4), " is not allowed in YAML text"));
    }
    i += len;
    ++column;
  }
  return absl::OkStatus();
}

// Counts a text's documents and nodes from parser events, before yaml-cpp builds its (heavy) tree.
class Census : public YAML::EventHandler {
 public:
  int documents = 0;
  int64_t nodes = 0;
  std::vector<YAML::Mark> starts;  // of the first three documents
  YAML::Mark over_limit = YAML::Mark::null_mark();

  void OnDocumentStart(const YAML::Mark& mark) override {
    if (++documents <= 3) starts.push_back(mark);
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& mark, YAML::anchor_t) override { Count(mark); }
  void OnAlias(const YAML::Mark& mark, YAML::anchor_t) override { Count(mark); }
  void OnScalar(const YAML::Mark& mark, const std::string&, YAML::anchor_t, const std::string&) override {
    Count(mark);
  }
  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    Count(mark);
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    Count(mark);
  }
  void OnMapEnd() override {}

 private:
  void Count(const YAML::Mark& mark) {
    if (++nodes == kMaxYamlNodes + 1) over_limit = mark;
  }
};

absl::Status FromYamlException(const YAML::Exception& e) {
  if (e.mark.is_null()) return absl::InvalidArgumentError(e.msg);
  if (const auto* deep = dynamic_cast<const YAML::DeepRecursion*>(&e); deep != nullptr) {
    // yaml-cpp's own recursion limit, which it reports as "bad file".
    return absl::InvalidArgumentError(absl::StrCat(Position(e.mark.line + 1, e.mark.column + 1),
                                                   "nested deeper than yaml-cpp's limit (", deep->depth() - 1,
                                                   " levels)"));
  }
  return absl::InvalidArgumentError(absl::StrCat(Position(e.mark.line + 1, e.mark.column + 1), e.msg));
}

}  // namespace

absl::Status YamlToProto(const YAML::Node& node, Message* message, const std::string& path) {
  Budget budget;
  try {
    return ToMessage(node, message, path, 0, &budget);
  } catch (const YAML::Exception& e) {  // no node access above should throw; this is the boundary
    return Error(path, std::string(FromYamlException(e).message()));
  }
}

absl::Status YamlTextToProto(std::string_view yaml, Message* message) {
  if (static_cast<int64_t>(yaml.size()) > kMaxConfigFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the text is ", yaml.size(), " bytes; a config file may have at most ", kMaxConfigFileBytes, " (4 MiB)"));
  }
  if (auto s = CheckText(yaml); !s.ok()) return s;
  const std::string text(yaml);
  YAML::Node root;
  try {
    std::istringstream in(text);
    YAML::Parser parser(in);
    Census census;
    // Three at most: one is all a config may hold, and yaml-cpp 0.7 can return "another document"
    // forever without consuming input (a ',' outside [ ] and { }; found by config_fuzz), which
    // shows as two documents starting at the same place.
    for (int i = 0; i < 3 && parser.HandleNextDocument(census); ++i) {
    }
    if (census.documents > 1) {
      const std::vector<YAML::Mark>& starts = census.starts;
      for (size_t i = 1; i < starts.size(); ++i) {
        const YAML::Mark& m = starts[i];
        if (m.pos == starts[i - 1].pos && m.pos >= 0 && static_cast<size_t>(m.pos) < text.size()) {
          return absl::InvalidArgumentError(
              absl::StrCat(Position(m.line + 1, m.column + 1), "unexpected '", text.substr(m.pos, 1), "'"));
        }
      }
      const YAML::Mark& m = starts[1];
      return absl::InvalidArgumentError(
          absl::StrCat(Position(m.line + 1, m.column + 1), "a second YAML document; a config file holds one"));
    }
    if (census.nodes > kMaxYamlNodes) {
      const YAML::Mark& m = census.over_limit;
      return absl::InvalidArgumentError(absl::StrCat(Position(m.line + 1, m.column + 1), "more than ", kMaxYamlNodes,
                                                     " YAML nodes (scalars, lists, mappings, aliases)"));
    }
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return FromYamlException(e);
  }
  return YamlToProto(root, message);
}

absl::StatusOr<std::string> ReadConfigText(const std::string& path) {
  // O_NONBLOCK: opening a FIFO with no writer would wait forever; the type is checked before any
  // read, so only a regular file is ever read.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    const std::string message = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(message) : absl::InvalidArgumentError(message);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0)
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot stat: ", std::strerror(errno)));
  if (S_ISDIR(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(path, ": is a directory, not a file"));
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISSOCK(st.st_mode) ? "a socket" : "a device";
    return absl::InvalidArgumentError(absl::StrCat(path, ": is not a regular file (", kind, ")"));
  }
  const auto too_big = [&](int64_t size) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": is ", size, " bytes; a config file may have at most ", kMaxConfigFileBytes, " (4 MiB)"));
  };
  if (st.st_size > kMaxConfigFileBytes) return too_big(st.st_size);
  std::string text;
  char chunk[64 * 1024];
  for (;;) {
    const ssize_t n = ::read(fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read: ", std::strerror(errno)));
    if (n == 0) break;
    text.append(chunk, static_cast<size_t>(n));
    if (static_cast<int64_t>(text.size()) > kMaxConfigFileBytes)
      return too_big(static_cast<int64_t>(text.size()));  // it grew
  }
  return text;
}

}  // namespace keyguard::config
