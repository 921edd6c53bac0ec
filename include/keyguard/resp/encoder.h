// Encoders for the commands and replies keyguard produces itself. Each appends to `out`.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace keyguard::resp {

struct Value;

// "-<text>\r\n"; `text` must hold no CR or LF (they are replaced by spaces, as Redis does).
void AppendError(std::string* out, std::string_view text);
// "+<text>\r\n"; CR and LF are replaced by spaces.
void AppendSimple(std::string* out, std::string_view text);
void AppendInteger(std::string* out, int64_t value);
void AppendBulk(std::string* out, std::string_view value);
// Writes "$<len>\r\n<value>\r\n" at `out`, which must have room for value.size() + kBulkOverhead
// bytes; returns the end of what it wrote. For callers that size a buffer once for many pieces.
inline constexpr size_t kBulkOverhead = 25;  // '$', at most 20 digits, two CRLFs
char* WriteBulk(char* out, std::string_view value);
void AppendNullBulk(std::string* out);
void AppendArrayHeader(std::string* out, int64_t count);
// A command as a multibulk request: "*<n>\r\n$<len>\r\n<arg>\r\n...".
void AppendCommand(std::string* out, std::span<const std::string_view> args);
// The same, written at `out`, which must have room for CommandBound(args) bytes; returns the end.
char* WriteCommand(char* out, std::span<const std::string_view> args);
size_t CommandBound(std::span<const std::string_view> args);

// Re-encodes a parsed value (attributes included; an unparsed one as its bytes); aggregate
// lengths follow `elements`, so elements removed from a parsed reply are gone from the encoding
// too.
void AppendValue(std::string* out, const Value& v);

}  // namespace keyguard::resp
