// The live configuration and its reloads. The settings that can change while running (the key
// policy, the deny list, unknown_commands) are swapped as one immutable snapshot; workers notice
// a new version with one relaxed atomic load per batch and take the snapshot under a mutex.
// Listen, upstream, admin, threads and limits need a restart; a reload that changes them says so.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <sys/stat.h>

#include "keyguard/config/config.h"

namespace keyguard::config {

class ConfigStore {
 public:
  // `path` may be empty (no file: nothing to reload).
  ConfigStore(std::shared_ptr<const ProxyConfig> initial, std::string path);

  uint64_t version() const { return version_.load(std::memory_order_acquire); }
  std::shared_ptr<const ProxyConfig> Current() const;

  // Loads the file again. On success the new snapshot is live; on failure the old one stays and
  // the error is kept. Returns the outcome.
  absl::Status Reload(const char* trigger);
  // Reloads when the file's identity (inode, size, mtime) changed since the last look; a
  // Kubernetes ConfigMap update swaps a symlink, which changes the inode. Call it periodically.
  void PollFile();

  uint64_t reloads() const { return reloads_.load(); }
  uint64_t failures() const { return failures_.load(); }
  // A human-readable status for /config: version, source, last reload and error, settings.
  std::string Describe() const;
  const std::string& path() const { return path_; }

 private:
  struct FileId {
    ino_t inode = 0;
    off_t size = -1;
    int64_t mtime_ns = 0;
    bool operator==(const FileId&) const = default;
  };
  FileId Stat() const;

  mutable std::mutex mu_;
  std::shared_ptr<const ProxyConfig> current_;
  std::string path_;
  FileId file_id_;
  std::string last_error_;
  std::string last_trigger_ = "startup";
  std::atomic<uint64_t> version_{1};
  std::atomic<uint64_t> reloads_{0};
  std::atomic<uint64_t> failures_{0};
};

// The effective settings as YAML-like text (check-config, /config).
std::string DescribeConfig(const ProxyConfig& c);

}  // namespace keyguard::config
