#include "keyguard/hygiene/detectors.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace keyguard::hygiene {

int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kSerializedRmw: return "serialized_rmw";
    case Kind::kLostUpdateRisk: return "lost_update_risk";
    case Kind::kBigStringWrite: return "big_string_write";
    case Kind::kBigStringRead: return "big_string_read";
    case Kind::kWholeCollectionRead: return "whole_collection_read";
    case Kind::kKeysCommand: return "keys_command";
    case Kind::kFlushWithoutAsync: return "flush_without_async";
    case Kind::kHashCandidate: return "hash_candidate";
    case Kind::kBigKeyAccess: return "big_key_access";
    case Kind::kDelBigKey: return "del_big_key";
    case Kind::kExpireBigKey: return "expire_big_key";
    case Kind::kMissingTtl: return "missing_ttl";
    case Kind::kExpiryClustering: return "expiry_clustering";
    case Kind::kCount: break;
  }
  return "unknown";
}

bool CanRewrite(Kind k) {
  return k == Kind::kDelBigKey || k == Kind::kFlushWithoutAsync || k == Kind::kMissingTtl ||
         k == Kind::kExpiryClustering;
}

bool CanReject(Kind k) {
  // Known before the command is forwarded: from its arguments, or a size the cache already holds.
  return k != Kind::kBigStringRead && k != Kind::kBigKeyAccess;
}

std::string ShownKey(std::string_view key, KeyMode mode) {
  switch (mode) {
    case KeyMode::kRaw: return std::string(key);
    case KeyMode::kHashed: {
      // FNV-1a 64: stable across restarts and processes, so one key's findings still group.
      return absl::StrCat("hash:", absl::Hex(Fingerprint(key), absl::kZeroPad16));
    }
    case KeyMode::kRedacted: return "";
  }
  return "";
}

std::string FindingJson(const Finding& f, int64_t unix_ms) {
  std::string out = absl::StrCat("{\"time_ms\":", unix_ms, ",\"kind\":", JsonString(KindName(f.kind)),
                                 ",\"rule\":", JsonString(KindName(f.kind)),
                                 ",\"action\":", JsonString(ActionName(f.action)), ",\"key\":", JsonString(f.key),
                                 ",\"key_pattern\":", JsonString(f.key_pattern), ",\"command\":", JsonString(f.command),
                                 ",\"client\":", JsonString(f.client), ",\"client_name\":", JsonString(f.client_name));
  if (!f.tenant.empty()) absl::StrAppend(&out, ",\"tenant\":", JsonString(f.tenant));
  if (!f.format.empty()) absl::StrAppend(&out, ",\"format\":", JsonString(f.format));
  if (f.bytes >= 0) absl::StrAppend(&out, ",\"bytes\":", f.bytes);
  if (f.elements >= 0) absl::StrAppend(&out, ",\"elements\":", f.elements);
  if (f.fields_changed >= 0) absl::StrAppend(&out, ",\"fields_changed\":", f.fields_changed);
  if (f.fields_total >= 0) absl::StrAppend(&out, ",\"fields_total\":", f.fields_total);
  if (f.keys >= 0) absl::StrAppend(&out, ",\"keys\":", f.keys);
  if (f.ttl_s >= 0) absl::StrAppend(&out, ",\"ttl_s\":", f.ttl_s);
  absl::StrAppend(&out, ",\"suggestion\":", JsonString(f.suggestion), "}");
  return out;
}

FindingLog::FindingLog(size_t capacity, std::string file) : capacity_(capacity) {
  if (file.empty()) return;
  out_ = std::fopen(file.c_str(), "a");
  if (out_ == nullptr) {
    out_ = stderr;
    file_ok_ = false;
  }
}

FindingLog::~FindingLog() {
  if (out_ != stderr) std::fclose(out_);
}

void FindingLog::Add(const Finding& f) {
  const int64_t now_ms = UnixMs();
  std::string line = FindingJson(f, now_ms);
  std::lock_guard<std::mutex> lock(mu_);
  const std::string limit_key = absl::StrCat(KindName(f.kind), "|", f.key_pattern);
  auto [it, fresh] =
      f.action == Action::kObserve ? std::make_pair(last_logged_.end(), false) : last_logged_.try_emplace(limit_key, 0);
  if (it != last_logged_.end() && (fresh || now_ms / 1000 - it->second >= 10)) {
    it->second = now_ms / 1000;
    const std::string log = absl::StrCat("{\"level\":\"", f.action == Action::kWarn ? "warn" : "info",
                                         "\",\"event\":\"finding\",", line.substr(1), "\n");
    std::fwrite(log.data(), 1, log.size(), out_);
    if (out_ != stderr) std::fflush(out_);
  }
  if (last_logged_.size() > 10000) last_logged_.clear();  // bounded; at worst a line repeats early
  recent_.push_back(std::move(line));
  while (recent_.size() > capacity_) recent_.pop_front();
}

std::string FindingLog::RecentJson() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = "{\"findings\":[";
  for (size_t i = 0; i < recent_.size(); ++i) absl::StrAppend(&out, i ? "," : "", recent_[i]);
  out += "]}\n";
  return out;
}

void RmwTracker::OnReadHashed(uint64_t key_hash, uint64_t session, std::string_view value, int64_t now_ms) {
  const Format format = DetectFormat(value);
  if (format == Format::kNone && entries_.empty()) return;  // the common case costs nothing
  const uint64_t h = key_hash;
  if (format == Format::kNone) {
    entries_.erase(h);
    return;
  }
  if (entries_.size() >= std::max<size_t>(1, settings_.tracked_keys / shards_) && !entries_.contains(h)) {
    entries_.erase(entries_.begin());  // bounded: forget an arbitrary key
  }
  Entry& e = entries_[h];
  e.format = format;
  e.fields.clear();
  if (format == Format::kJsonObject) JsonTopLevelFields(value, &e.fields);
  for (Reader& r : e.readers) {
    if (r.session == session) {
      r = Reader{session, now_ms, false};
      return;
    }
  }
  if (e.readers.size() >= 8) e.readers.erase(e.readers.begin());
  e.readers.push_back(Reader{session, now_ms, false});
}

void RmwTracker::OnWriteHashed(uint64_t key_hash, uint64_t session, std::string_view value, bool watched,
                               int64_t now_ms, std::vector<Result>* out) {
  if (entries_.empty()) return;
  auto it = entries_.find(key_hash);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  std::erase_if(e.readers, [&](const Reader& r) { return now_ms - r.at_ms > settings_.rmw_window_ms; });
  auto self = std::find_if(e.readers.begin(), e.readers.end(), [&](const Reader& r) { return r.session == session; });
  std::vector<std::pair<uint64_t, uint64_t>> fields;
  const bool json = e.format == Format::kJsonObject && JsonTopLevelFields(value, &fields);
  if (self != e.readers.end()) {
    Result rmw{Kind::kSerializedRmw, e.format};
    if (json) {
      int64_t changed = 0;
      // Plain pairs, not structured bindings: clang 14 (the fuzz build) cannot capture those.
      for (const auto& field : fields) {
        auto old =
            std::find_if(e.fields.begin(), e.fields.end(), [&](const auto& f) { return f.first == field.first; });
        if (old == e.fields.end() || old->second != field.second) ++changed;
      }
      for (const auto& field : e.fields) {
        if (std::none_of(fields.begin(), fields.end(), [&](const auto& f) { return f.first == field.first; }))
          ++changed;
      }
      rmw.fields_changed = changed;
      rmw.fields_total = static_cast<int64_t>(std::max(fields.size(), e.fields.size()));
    }
    out->push_back(rmw);
    if (self->stale && !watched) out->push_back(Result{Kind::kLostUpdateRisk, e.format});
    e.readers.erase(self);
  }
  // Everyone else who read the old value now holds a stale copy.
  for (Reader& r : e.readers) r.stale = true;
  if (json) e.fields = std::move(fields);
  if (e.readers.empty()) entries_.erase(it);
}

bool AttributeTracker::OnParentWrite(std::string_view key, std::string_view parent_name, uint64_t parent_hash,
                                     int64_t now_ms, std::string* parent, std::vector<std::string>* attributes) {
  const size_t colon = parent_name.size();
  const std::string_view attribute = key.substr(colon + 1);
  if (now_ms < 0) now_ms = UnixMs();
  const uint64_t h = parent_hash;
  auto it = parents_.find(h);
  if (it == parents_.end()) {
    if (parents_.size() >= std::max<size_t>(1, settings_.tracked_keys / shards_)) {
      parents_.erase(parents_.begin());  // bounded
    }
    it = parents_.emplace(h, Parent{now_ms, false, {}}).first;
  }
  Parent& p = it->second;
  if (now_ms - p.first_ms > settings_.rmw_window_ms) p = Parent{now_ms, false, {}};
  if (p.reported) return false;
  if (std::find(p.attributes.begin(), p.attributes.end(), attribute) != p.attributes.end()) return false;
  p.attributes.emplace_back(attribute);
  if (p.attributes.size() < kThreshold) return false;
  p.reported = true;
  parent->assign(key.data(), colon);
  *attributes = p.attributes;
  p.attributes.clear();
  p.attributes.shrink_to_fit();
  return true;
}

}  // namespace keyguard::hygiene
