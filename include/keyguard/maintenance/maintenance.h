// The maintenance subcommands: `keyguard audit` (what the keys already in Redis break) and
// `keyguard migrate` (copy, verify and clean up renamed and re-shaped keys). Both read the
// proxy's config file and talk to the upstream Redis with a blocking client.
#pragma once

#include <string>
#include <vector>

namespace keyguard::maintenance {

extern const char kAuditUsage[];
extern const char kMigrateUsage[];

// `args` are the words after the subcommand name. Exit codes: 0 fine, 1 findings reached
// --fail-on (audit) or old and new keys differ (migrate verify), 2 usage, config or connection
// errors.
int RunAudit(const std::vector<std::string>& args);
int RunMigrate(const std::vector<std::string>& args);

}  // namespace keyguard::maintenance
