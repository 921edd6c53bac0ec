#include "config/yaml_proto.h"

#include <fstream>
#include <limits>
#include <sstream>
#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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

template <typename T>
absl::Status ParseInt(const YAML::Node& n, const std::string& path, T* out) {
  int64_t v;
  constexpr int64_t lo = static_cast<int64_t>(std::numeric_limits<T>::min());
  constexpr uint64_t hi = static_cast<uint64_t>(std::numeric_limits<T>::max());
  if (!n.IsScalar() || !absl::SimpleAtoi(n.Scalar(), &v)) {
    uint64_t u;
    if (n.IsScalar() && absl::SimpleAtoi(n.Scalar(), &u) && u <= hi) {
      *out = static_cast<T>(u);
      return absl::OkStatus();
    }
    return Error(path, "expected an integer");
  }
  if (v < lo || (v > 0 && static_cast<uint64_t>(v) > hi)) {
    return Error(path, absl::StrCat("must be between ", lo, " and ", hi));
  }
  *out = static_cast<T>(v);
  return absl::OkStatus();
}

absl::Status SetScalar(const YAML::Node& n, Message* m, const FieldDescriptor* f, const std::string& path) {
  const Reflection* r = m->GetReflection();
  const bool rep = f->is_repeated();
  if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE && !n.IsScalar()) {
    return Error(path, f->cpp_type() == FieldDescriptor::CPPTYPE_STRING ? "expected a string" : "expected a scalar value");
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
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_DOUBLE) {
        rep ? r->AddDouble(m, f, v) : r->SetDouble(m, f, v);
      } else {
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
      return Error(path, absl::StrCat("'", n.Scalar(), "' is not one of ", absl::StrJoin(names, ", ")));
    }
    case FieldDescriptor::CPPTYPE_MESSAGE: {
      Message* child = rep ? r->AddMessage(m, f) : r->MutableMessage(m, f);
      return YamlToProto(n, child, path);
    }
  }
  return Error(path, "unsupported field type");
}

}  // namespace

absl::Status YamlToProto(const YAML::Node& node, Message* message, const std::string& path) {
  if (!node || node.IsNull()) return absl::OkStatus();
  if (!node.IsMap()) return Error(path, "expected a mapping");
  const Descriptor* d = message->GetDescriptor();
  for (const auto& kv : node) {
    const std::string key = kv.first.as<std::string>();
    const std::string field_path = Join(path, key);
    const FieldDescriptor* f = d->FindFieldByName(key);
    if (f == nullptr) {
      std::set<std::string> known;
      for (int i = 0; i < d->field_count(); ++i) known.insert(d->field(i)->name());
      return Error(field_path, absl::StrCat("unknown field (known: ", absl::StrJoin(known, ", "), ")"));
    }
    const YAML::Node& value = kv.second;
    if (f->is_repeated()) {
      if (value.IsNull()) continue;
      if (!value.IsSequence()) return Error(field_path, "expected a list");
      for (size_t i = 0; i < value.size(); ++i) {
        if (auto s = SetScalar(value[i], message, f, absl::StrCat(field_path, "[", i, "]")); !s.ok()) return s;
      }
      continue;
    }
    if (auto s = SetScalar(value, message, f, field_path); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status YamlTextToProto(std::string_view yaml, Message* message) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("line ", e.mark.line + 1, ", column ", e.mark.column + 1, ": ", e.msg));
  }
  return YamlToProto(root, message);
}

absl::StatusOr<std::string> ReadConfigText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace keyguard::config
