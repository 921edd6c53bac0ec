// What tells that a file changed on disk: its mtime, size and inode (a Kubernetes Secret's
// symlink swap changes them). Files that keyguard reads again when they change (TLS
// certificates, keys and CAs; the upstream password file) are compared by it.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <string>

namespace keyguard::proxy {

struct FileStamp {
  int64_t mtime_ns = 0;
  int64_t size = -1;
  ino_t inode = 0;
  bool operator==(const FileStamp&) const = default;

  // The stamp of `path` now; a missing file (or an empty path) has the default stamp.
  static FileStamp Of(const std::string& path) {
    FileStamp s;
    struct stat st;
    if (!path.empty() && ::stat(path.c_str(), &st) == 0) {
      s.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
      s.size = st.st_size;
      s.inode = st.st_ino;
    }
    return s;
  }
};

}  // namespace keyguard::proxy
