#include "maintenance/redis_link.h"

#include <algorithm>

#include <hiredis/hiredis.h>

#include <cstdlib>
#include <thread>

#include "absl/strings/str_cat.h"

namespace keyguard::maintenance {
namespace {

Reply Convert(const redisReply* r) {
  Reply out;
  switch (r->type) {
    case REDIS_REPLY_INTEGER:
      out.kind = Reply::Kind::kInteger;
      out.integer = r->integer;
      break;
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS:
    case REDIS_REPLY_ERROR:
      out.kind = r->type == REDIS_REPLY_STRING   ? Reply::Kind::kString
                 : r->type == REDIS_REPLY_STATUS ? Reply::Kind::kStatus
                                                 : Reply::Kind::kError;
      out.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_ARRAY:
      out.kind = Reply::Kind::kArray;
      out.elements.reserve(r->elements);
      for (size_t i = 0; i < r->elements; ++i) out.elements.push_back(Convert(r->element[i]));
      break;
    default: break;  // nil
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RedisLink>> RedisLink::Connect(const config::Upstream& upstream, int db) {
  if (upstream.tls || upstream.kind != config::Upstream::Kind::kDirect) {
    return absl::UnimplementedError(absl::StrCat("upstream ", upstream.ToString(),
                                                 ": audit and migrate reach Redis over plain TCP only (HOST:PORT or "
                                                 "redis://); point --upstream at the server itself"));
  }
  return Connect(upstream.address, db);
}

absl::StatusOr<std::vector<config::HostPort>> RedisLink::ClusterPrimaries(const config::Upstream& upstream) {
  if (upstream.tls) {
    return absl::UnimplementedError(
        absl::StrCat("upstream ", upstream.ToString(), ": audit and migrate reach Redis over plain TCP only"));
  }
  std::string errors;
  for (const config::HostPort& seed : upstream.seeds) {
    auto link = Connect(seed, 0);
    if (!link.ok()) {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", link.status().message());
      continue;
    }
    auto slots = (*link)->Call({"CLUSTER", "SLOTS"});
    if (!slots.ok() || slots->kind != Reply::Kind::kArray) {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", seed.ToString(), ": no CLUSTER SLOTS");
      continue;
    }
    // (first slot, primary) of each range; a primary once, at its first slot.
    std::vector<std::pair<int64_t, config::HostPort>> ranges;
    for (const Reply& r : slots->elements) {
      if (r.elements.size() < 3 || r.elements[2].elements.size() < 2) continue;
      const Reply& node = r.elements[2];
      config::HostPort hp{node.elements[0].str.empty() ? seed.host : node.elements[0].str,
                          static_cast<uint16_t>(node.elements[1].integer)};
      ranges.emplace_back(r.elements[0].integer, hp);
    }
    std::sort(ranges.begin(), ranges.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<config::HostPort> primaries;
    for (const auto& [first, hp] : ranges) {
      const bool known = std::any_of(primaries.begin(), primaries.end(),
                                     [&](const config::HostPort& p) { return p.host == hp.host && p.port == hp.port; });
      if (!known) primaries.push_back(hp);
    }
    if (!primaries.empty()) return primaries;
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", seed.ToString(), ": no slot is served");
  }
  return absl::UnavailableError(absl::StrCat("upstream ", upstream.ToString(), ": ", errors));
}

absl::StatusOr<std::unique_ptr<RedisLink>> RedisLink::Connect(const config::HostPort& where, int db) {
  const timeval connect_timeout{5, 0};
  redisContext* c = redisConnectWithTimeout(where.host.c_str(), where.port, connect_timeout);
  if (c == nullptr) return absl::UnavailableError(absl::StrCat(where.ToString(), ": cannot allocate a connection"));
  std::unique_ptr<RedisLink> link(new RedisLink(c));
  if (c->err) return absl::UnavailableError(absl::StrCat(where.ToString(), ": ", c->errstr));
  // A reply that takes longer than this means a stuck server, not a slow batch.
  const timeval io_timeout{60, 0};
  redisSetTimeout(c, io_timeout);
  if (const char* password = std::getenv("REDISCLI_AUTH"); password != nullptr && *password != '\0') {
    auto r = link->Call({"AUTH", password});
    if (!r.ok()) return r.status();
    if (r->is_error()) return absl::PermissionDeniedError(absl::StrCat(where.ToString(), ": AUTH: ", r->str));
  }
  if (db != 0) {
    auto r = link->Call({"SELECT", absl::StrCat(db)});
    if (!r.ok()) return r.status();
    if (r->is_error()) return absl::InvalidArgumentError(absl::StrCat(where.ToString(), ": SELECT ", db, ": ", r->str));
  }
  return link;
}

RedisLink::~RedisLink() { redisFree(c_); }

absl::StatusOr<std::vector<Reply>> RedisLink::Pipeline(const std::vector<Command>& commands) {
  std::vector<const char*> argv;
  std::vector<size_t> lengths;
  for (const Command& cmd : commands) {
    argv.clear();
    lengths.clear();
    for (const std::string& a : cmd) {
      argv.push_back(a.data());
      lengths.push_back(a.size());
    }
    if (redisAppendCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lengths.data()) != REDIS_OK) {
      return absl::InternalError(absl::StrCat("redis: ", c_->errstr));
    }
  }
  std::vector<Reply> replies;
  replies.reserve(commands.size());
  for (size_t i = 0; i < commands.size(); ++i) {
    void* raw = nullptr;
    if (redisGetReply(c_, &raw) != REDIS_OK || raw == nullptr) {
      return absl::UnavailableError(absl::StrCat("redis: ", c_->err ? c_->errstr : "connection lost"));
    }
    replies.push_back(Convert(static_cast<redisReply*>(raw)));
    freeReplyObject(raw);
  }
  return replies;
}

absl::StatusOr<Reply> RedisLink::Call(const Command& command) {
  auto r = Pipeline({command});
  if (!r.ok()) return r.status();
  return std::move((*r)[0]);
}

void Pacer::Before(size_t n) {
  if (per_second_ != 0) {
    // The batch may start when the commands already sent fit the cap: sent / rate seconds in.
    const auto due = start_ + std::chrono::microseconds(sent_ * 1000000 / per_second_);
    std::this_thread::sleep_until(due);
  }
  sent_ += n;
}

}  // namespace keyguard::maintenance
