// Maps a YAML document onto a protobuf message by reflection, field by field, so that every
// error names the field path: `key_policy.rules[2].action: 'rejekt' is not one of observe,
// warn, rewrite, reject`. Unknown keys are errors. Enum values match case-insensitively.
//
// Nothing here throws: every yaml-cpp exception is turned into an InvalidArgument status, and a
// file that is too big, not text, or that expands past the limits below is refused before it
// can take the process's memory. The limits (documented in proto/README.md):
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <google/protobuf/message.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "yaml-cpp/yaml.h"

namespace keyguard::config {

// A config file (or users file) larger than this is refused before it is read.
inline constexpr int64_t kMaxConfigFileBytes = 4 << 20;
// YAML nodes (scalars, lists, mappings, aliases) in the text, counted before the tree is built:
// yaml-cpp takes about 0.5 KB per node.
inline constexpr int64_t kMaxYamlNodes = 200000;
// After aliases are expanded: values visited and bytes of scalar text copied into the message.
// A "billion laughs" document (lists of aliases of lists of aliases) stops here.
inline constexpr int64_t kMaxExpandedValues = 1000000;
inline constexpr int64_t kMaxExpandedScalarBytes = 16 << 20;
// Mappings and lists nested deeper than this (the schema needs fewer than 10); it also stops
// an alias that refers to its own anchor (`&a [*a]`).
inline constexpr int kMaxYamlDepth = 32;

// `node` onto `message`; `path` prefixes every field path in errors. Refuses non-scalar keys,
// duplicate keys, merge keys (<<), explicit tags (!!str, !foo), and documents past the limits.
absl::Status YamlToProto(const YAML::Node& node, google::protobuf::Message* message, const std::string& path = "");
// The same from YAML text: one document of printable UTF-8 (NUL, other control characters and
// invalid UTF-8 are refused with their line and column); a YAML syntax error names the line and
// column.
absl::Status YamlTextToProto(std::string_view yaml, google::protobuf::Message* message);
// A config file's whole text. Only a regular file (after symlinks) of at most
// kMaxConfigFileBytes: "PATH: cannot open: No such file or directory" (NotFound),
// "PATH: is a directory, not a file", "PATH: is not a regular file (a FIFO)", "PATH: is 10485760
// bytes; a config file may have at most 4194304 (4 MiB)". Never blocks on a FIFO or device.
absl::StatusOr<std::string> ReadConfigText(const std::string& path);

}  // namespace keyguard::config
