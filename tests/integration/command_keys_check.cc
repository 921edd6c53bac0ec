// Reads cases written by test_command_keys.py (arguments and what the real server's
// COMMAND GETKEYS answered) and checks that keyguard's FindKeys agrees.
// Line format: hex-encoded arguments separated by spaces, a tab, then "E" (the server refused:
// invalid arguments), "K" followed by the hex-encoded keys in order, or "S" followed by the
// hex-encoded key names as a set (the same name may stand at two positions that are both keys).
// Prints each disagreement and exits 1 if there was any.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "keyguard/commands/command_table.h"

namespace {

std::string Unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  return out;
}

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  std::string w;
  while (in >> w) out.push_back(w == "-" ? "" : Unhex(w));
  return out;
}

std::string Show(const std::vector<std::string>& v) {
  std::string s = "[";
  for (const auto& x : v) s += "'" + x + "' ";
  return s + "]";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace keyguard::commands;
  if (argc != 2) return 2;
  std::ifstream in(argv[1]);
  std::string line;
  int cases = 0, mismatches = 0;
  while (std::getline(in, line)) {
    const size_t tab = line.find('\t');
    if (tab == std::string::npos) continue;
    const std::vector<std::string> args = Split(line.substr(0, tab));
    const std::string expect = line.substr(tab + 1);
    std::vector<std::string_view> views(args.begin(), args.end());
    const CommandSpec* spec = ResolveSpec(LookupCommand(views[0]), views);
    std::vector<KeyRef> refs;
    const bool ok = spec != nullptr && FindKeys(*spec, views, &refs);
    std::vector<std::string> ours;
    for (const KeyRef& r : refs) ours.push_back(args[r.pos]);
    ++cases;
    bool agree;
    if (expect == "E") {
      agree = !ok || ours.empty();
    } else if (expect[0] == 'S') {
      auto as_set = [](std::vector<std::string> v) {
        std::sort(v.begin(), v.end());
        v.erase(std::unique(v.begin(), v.end()), v.end());
        return v;
      };
      agree = ok && as_set(ours) == as_set(Split(expect.substr(1)));
    } else {
      agree = ok && ours == Split(expect.substr(1));
    }
    if (!agree) {
      ++mismatches;
      std::cout << "MISMATCH " << Show(args) << " server=" << (expect == "E" ? "error" : Show(Split(expect.substr(1))))
                << " keyguard=" << (ok ? Show(ours) : "invalid") << "\n";
    }
  }
  std::cout << cases << " cases, " << mismatches << " mismatches\n";
  return mismatches == 0 ? 0 : 1;
}
