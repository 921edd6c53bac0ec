#include "keyguard/config/config_store.h"

#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "keyguard/hygiene/detectors.h"

namespace keyguard::config {

ConfigStore::ConfigStore(std::shared_ptr<const ProxyConfig> initial, std::string path)
    : current_(std::move(initial)), path_(std::move(path)) {
  file_id_ = Stat();
}

std::shared_ptr<const ProxyConfig> ConfigStore::Current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

ConfigStore::FileId ConfigStore::Stat() const {
  FileId id;
  struct stat st;
  if (!path_.empty() && ::stat(path_.c_str(), &st) == 0) {
    id.inode = st.st_ino;
    id.size = st.st_size;
    id.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  }
  return id;
}

absl::Status ConfigStore::Reload(const char* trigger) {
  if (path_.empty()) return absl::FailedPreconditionError("no config file to reload");
  auto loaded = LoadConfigFile(path_);
  std::lock_guard<std::mutex> lock(mu_);
  last_trigger_ = trigger;
  if (!loaded.ok()) {
    failures_.fetch_add(1);
    last_error_ = std::string(loaded.status().message());
    EventLine("error", "config_reload_failed")
        .Str("trigger", trigger)
        .Int("version", static_cast<int64_t>(version_.load()))
        .Str("error", last_error_)
        .Write(stderr);
    return loaded.status();
  }
  // Only the reloadable settings change; listen, upstream, admin, threads and limits stay as
  // the process started (flags may have overridden them).
  auto next = std::make_shared<ProxyConfig>(*current_);
  next->key_policy = loaded->key_policy;
  next->deny_commands = loaded->deny_commands;
  next->reject_unknown_commands = loaded->reject_unknown_commands;
  current_ = std::move(next);
  last_error_.clear();
  reloads_.fetch_add(1);
  const uint64_t v = version_.fetch_add(1, std::memory_order_acq_rel) + 1;
  EventLine("info", "config_reloaded").Str("trigger", trigger).Int("version", static_cast<int64_t>(v)).Write(stderr);
  return absl::OkStatus();
}

void ConfigStore::PollFile() {
  const FileId id = Stat();
  if (id == file_id_) return;
  file_id_ = id;
  if (id.size >= 0) (void)Reload("file change");  // the outcome is logged and counted
}

std::string ConfigStore::Describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  return absl::StrCat(
      "version: ", version_.load(), "\nsource: ", path_.empty() ? "(flags and defaults)" : path_,
      "\nlast_reload_trigger: ", last_trigger_, "\nreloads: ", reloads_.load(), "\nreload_failures: ", failures_.load(),
      "\nlast_reload_error: ", last_error_.empty() ? "none" : last_error_, "\n---\n", DescribeConfig(*current_));
}

namespace {

// The CA files of `t` for check-config, or `none` when it names none.
std::string CaFiles(const TlsSettings& t, const char* none) {
  if (t.ca_file.empty() && t.ca_dir.empty()) return none;
  return absl::StrCat(t.ca_file, t.ca_file.empty() || t.ca_dir.empty() ? "" : ", ", t.ca_dir);
}

}  // namespace

std::string DescribeConfig(const ProxyConfig& c) {
  std::string out = absl::StrCat(
      "listen: ", c.listen.ToString(), "\nupstream: ", c.upstream.ToString(), "\nadmin: ", c.admin.ToString(),
      "\nthreads: ", c.threads, "\nupstream_connect_timeout_ms: ", c.upstream_connect_timeout_ms,
      "\nupstream_connections: ", c.shared_upstream ? "shared" : "dedicated",
      c.shared_upstream ? absl::StrCat("\nshared_connections: ", c.shared_connections,
                                       "\npinned_idle_connections: ", c.pinned_idle_connections,
                                       "\nshared_reply_timeout_ms: ", c.shared_reply_timeout_ms)
                        : std::string(),
      c.upstream.kind == Upstream::Kind::kCluster
          ? absl::StrCat("\ncluster:\n  read_from: ", c.read_from_replicas ? "replica_preferred" : "primary")
          : std::string(),
      "\ndrain_timeout_ms: ", c.drain_timeout_ms, "\ndeny_commands: [", absl::StrJoin(c.deny_commands, ", "),
      "]\nlimits:\n  max_bulk_len: ", c.limits.max_bulk_len, "\n  max_multibulk_len: ", c.limits.max_multibulk_len,
      "\n  max_inline_len: ", c.limits.max_inline_len, "\n  max_pending_commands: ", c.max_pending_commands,
      "\n  max_output_buffer: ", c.max_output_buffer, "\n  read_buffer_size: ", c.read_buffer_size,
      "\n  slow_client_grace_ms: ", c.slow_client_grace_ms,
      "\nunknown_commands: ", c.reject_unknown_commands ? "reject" : "forward",
      "\nkey_policy:", c.key_policy->empty() ? " off" : "", "\n");
  for (const auto& r : c.key_policy->rules()) {
    absl::StrAppend(&out, "  - rule: ", r.name, "\n    action: ", policy::ActionName(r.action), "\n");
    if (r.action == policy::Action::kRewrite && r.kind == policy::Rule::Kind::kUser) {
      absl::StrAppend(&out, "    legacy_keys: ", r.move_legacy ? "move" : "leave",
                      r.json_to_hash ? "\n    reshape: json_to_hash" : "",
                      "\n    reversible: ", r.reverse != nullptr ? "yes" : "no", "\n");
    }
    if (!r.scope.commands.empty() || r.scope.flags != 0 || r.scope.acl != 0)
      absl::StrAppend(&out, "    scoped: true\n");
  }
  absl::StrAppend(&out, "  scripts: ", policy::ActionName(c.key_policy->scripts_rule().action), " (",
                  c.key_policy->reviewed_scripts(), " reviewed scripts, ", c.key_policy->reviewed_functions(),
                  " reviewed functions)\n");
  const hygiene::Settings& h = c.hygiene;
  absl::StrAppend(&out, "hygiene:", h.enabled ? "" : " off", "\n");
  if (h.enabled) {
    absl::StrAppend(&out, "  big_string_bytes: ", h.big_string_bytes,
                    "\n  big_collection_elements: ", h.big_collection_elements, "\n  probe: ", h.probe ? "on" : "off",
                    "\n  rules:\n");
    for (size_t k = 0; k < hygiene::kKindCount; ++k) {
      absl::StrAppend(&out, "    ", hygiene::KindName(static_cast<hygiene::Kind>(k)), ": ",
                      hygiene::ActionName(h.actions[k]), "\n");
    }
    for (const hygiene::TtlPattern& t : h.ttl_patterns) {
      absl::StrAppend(&out, "  ttl_pattern: ", t.glob, t.session ? " (session)" : " (cache)",
                      t.default_ttl_s > 0 ? absl::StrCat(", default ", t.default_ttl_s, " s") : "", "\n");
    }
  }
  // Tenancy: who the tenants are, never a password or its hash.
  if (c.tenancy == nullptr) {
    absl::StrAppend(&out, "tenancy: off\n");
  } else {
    absl::StrAppend(&out, "tenancy:\n  mode: ", c.tenancy->requires_auth() ? "users" : "static", "\n");
    for (const auto& t : c.tenancy->tenants())
      absl::StrAppend(&out, "  - tenant: ", t->name, "\n    prefix: \"", t->prefix, "\"\n");
    for (const auto& u : c.tenancy->users()) absl::StrAppend(&out, "  - user: ", u.name, " -> ", u.tenant->name, "\n");
    const tenant::Tenancy& t = *c.tenancy;
    auto emulation = [](tenant::Emulation e) { return e == tenant::Emulation::kRefuse ? "refuse" : "walk"; };
    absl::StrAppend(&out, "  flush: ", emulation(t.flush), "\n  dbsize: ", emulation(t.dbsize),
                    "\n  randomkey: ", emulation(t.randomkey), "\n  walk_step_keys: ", t.walk_step_keys,
                    "\n  walk_steps_per_second: ", t.walk_steps_per_second,
                    "\n  allowed_scripts: ", t.allowed_scripts.size(),
                    "\n  allowed_functions: ", t.allowed_functions.size(), "\n");
  }
  absl::StrAppend(&out, "upstream_auth: ",
                  c.upstream_auth.password.empty()
                      ? "none"
                      : (c.UpstreamUser().empty() ? "password" : absl::StrCat("user ", c.UpstreamUser())),
                  "\n");
  // TLS and Sentinel: file names and choices, never a key or a password.
  if (c.upstream.tls) {
    const TlsSettings& t = c.upstream_tls;
    absl::StrAppend(&out, "upstream_tls:\n  ca: ", CaFiles(t, "system store"),
                    "\n  client_certificate: ", t.cert_file.empty() ? "none" : t.cert_file,
                    t.key_file.empty() ? "" : absl::StrCat(" (key ", t.key_file, ")"),
                    "\n  server_name: ", t.server_name.empty() ? "(the upstream host)" : t.server_name,
                    "\n  verify: ", t.verify ? "on" : "OFF", "\n  min_version: ", t.min_version,
                    "\n  ciphers: ", t.ciphers.empty() ? "default" : t.ciphers,
                    "\n  ciphersuites: ", t.ciphersuites.empty() ? "default" : t.ciphersuites, "\n");
  }
  if (c.ListenTls()) {
    const TlsSettings& t = c.listen_tls;
    absl::StrAppend(&out, "listen_tls:\n  certificate: ", t.cert_file, " (key ", t.key_file, ")",
                    "\n  client_ca: ", CaFiles(t, "none"), "\n  client_certificate: ",
                    t.require_client_cert                   ? "required"
                    : t.ca_file.empty() && t.ca_dir.empty() ? "not asked"
                                                            : "optional",
                    "\n  min_version: ", t.min_version, "\n  ciphers: ", t.ciphers.empty() ? "default" : t.ciphers,
                    "\n  ciphersuites: ", t.ciphersuites.empty() ? "default" : t.ciphersuites, "\n");
  }
  if (c.upstream.kind == Upstream::Kind::kSentinel) {
    absl::StrAppend(&out, "sentinel:\n  master: ", c.upstream.master, "\n  sentinels: ", c.upstream.sentinels.size(),
                    "\n  auth: ",
                    c.sentinel.password.empty()
                        ? "none"
                        : absl::StrCat(c.sentinel.user.empty() ? "password" : absl::StrCat("user ", c.sentinel.user),
                                       " (", c.sentinel.password_file, ")"),
                    "\n");
  }
  return out;
}

}  // namespace keyguard::config
