// Command names and dense ids. Ids index per-command metric arrays; id 0 stands for every command
// the table does not know, so label sets stay bounded whatever clients send.
// (Key specs and flags come with the full command table, issue 3.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace keyguard::commands {

using CommandId = uint16_t;
inline constexpr CommandId kUnknownCommand = 0;

// Case-insensitive lookup of a command name (the first argument of a request).
CommandId LookupCommand(std::string_view name);
// The lowercase name of `id`, "unknown" for kUnknownCommand.
std::string_view CommandName(CommandId id);
// Number of ids, kUnknownCommand included.
size_t CommandCount();

// Ids the proxy treats specially, resolved once.
struct KnownCommands {
  CommandId multi, exec, discard, subscribe, psubscribe, ssubscribe, unsubscribe, punsubscribe,
      sunsubscribe, hello, monitor, reset, quit, client;
};
const KnownCommands& Known();

// True when two names are equal ignoring ASCII case.
bool EqualsIgnoreCase(std::string_view a, std::string_view b);

}  // namespace keyguard::commands
