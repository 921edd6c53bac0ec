#include "keyguard/commands/command_table.h"

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace keyguard::commands {
namespace {

constexpr std::string_view kAllNames[] = {
#include "command_names.inc"
};

struct Table {
  std::vector<std::string_view> names;  // by id
  absl::flat_hash_map<std::string_view, CommandId> ids;
  size_t max_len = 0;

  Table() {
    names.push_back("unknown");
    for (std::string_view n : kAllNames) {
      if (n.find('|') != std::string_view::npos) continue;  // subcommands: not ids (yet)
      ids.emplace(n, static_cast<CommandId>(names.size()));
      names.push_back(n);
      if (n.size() > max_len) max_len = n.size();
    }
  }
};

const Table& GetTable() {
  static const Table* table = new Table();
  return *table;
}

}  // namespace

CommandId LookupCommand(std::string_view name) {
  const Table& t = GetTable();
  if (name.size() > t.max_len || name.empty()) return kUnknownCommand;
  char lower[64];
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    lower[i] = (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c;
  }
  auto it = t.ids.find(std::string_view(lower, name.size()));
  return it == t.ids.end() ? kUnknownCommand : it->second;
}

std::string_view CommandName(CommandId id) {
  const Table& t = GetTable();
  return id < t.names.size() ? t.names[id] : t.names[0];
}

size_t CommandCount() { return GetTable().names.size(); }

const KnownCommands& Known() {
  static const KnownCommands known{
      LookupCommand("multi"),        LookupCommand("exec"),         LookupCommand("discard"),
      LookupCommand("subscribe"),    LookupCommand("psubscribe"),   LookupCommand("ssubscribe"),
      LookupCommand("unsubscribe"),  LookupCommand("punsubscribe"), LookupCommand("sunsubscribe"),
      LookupCommand("hello"),        LookupCommand("monitor"),      LookupCommand("reset"),
      LookupCommand("quit"),         LookupCommand("client")};
  return known;
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = static_cast<char>(x + 32);
    if (y >= 'A' && y <= 'Z') y = static_cast<char>(y + 32);
    if (x != y) return false;
  }
  return true;
}

}  // namespace keyguard::commands
