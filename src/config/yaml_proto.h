// Maps a YAML document onto a protobuf message by reflection, field by field, so that every
// error names the field path: `key_policy.rules[2].action: 'rejekt' is not one of observe,
// warn, rewrite, reject`. Unknown keys are errors. Enum values match case-insensitively.
#pragma once

#include <string>
#include <string_view>

#include <google/protobuf/message.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "yaml-cpp/yaml.h"

namespace keyguard::config {

absl::Status YamlToProto(const YAML::Node& node, google::protobuf::Message* message, const std::string& path = "");
// The same from YAML text; a YAML syntax error names the line and column.
absl::Status YamlTextToProto(std::string_view yaml, google::protobuf::Message* message);
// A config file's whole text; NotFound "PATH: cannot open".
absl::StatusOr<std::string> ReadConfigText(const std::string& path);

}  // namespace keyguard::config
