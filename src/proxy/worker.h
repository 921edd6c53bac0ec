// What every session on one worker thread shares: the io_context, the settings, the metric shard.
// Everything here is used from that worker's thread only (the atomics are read by the server).
#pragma once

#include <array>
#include <functional>
#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "keyguard/config/config.h"
#include "keyguard/config/config_store.h"
#include "keyguard/hygiene/sizes.h"
#include "keyguard/hygiene/traffic.h"
#include "keyguard/hygiene/hot_keys.h"
#include "keyguard/metrics/registry.h"
#include "keyguard/resp/encoder.h"
#include "keyguard/tenant/connections.h"
#include "keyguard/tenant/rewrite.h"
#include "keyguard/tenant/walk.h"
#include "proxy/asio.h"
#include "proxy/cluster_map.h"
#include "proxy/credentials.h"
#include "proxy/pipeline.h"
#include "proxy/refusal.h"
#include "proxy/shared_upstream.h"
#include "proxy/tls.h"

namespace keyguard::proxy {

class ClusterClient;
class Session;
class SizeProbe;

// A Redis Cluster upstream, as one worker routes to it (cluster_client.h).
struct ClusterState {
  std::shared_ptr<cluster::SlotMap> map;  // this worker's copy: MOVED updates a slot at once
  std::vector<SharedLink*> node_links;    // by index in map->primaries (nullptr: not made yet)
  std::vector<SharedLink*> node_links3;   // the same for RESP3 clients (HELLO 3), made as they come
  // cluster.read_from: replica_preferred: the links to each primary's replicas (READONLY), by
  // index in map->primaries.
  std::vector<std::vector<SharedLink*>> replica_links;
  std::vector<std::vector<SharedLink*>> replica_links3;  // (made once a RESP3 client reads)
  bool resp3_replicas = false;                           // replica_links3 wanted: kept with each map
  size_t next_replica = 0;
  std::unordered_map<std::string, std::shared_ptr<SharedLink>> links;  // by "host:port", kept across maps
  // The links of nodes that left the map, retired (SharedLink::Retire) when they owed nothing:
  // freed once no client holds them and kRetiredGrace has passed (an entry's retry timer may
  // still name one: ClusterClient::Tries::ask). `retirements` counts them, so that clients drop
  // their queues of retired links (ClusterClient::DropRetiredQueues, on a client's next command
  // and on each sweep: FreeRetiredLinks, every kRetiredGrace while any is left).
  struct Retired {
    std::shared_ptr<SharedLink> link;
    std::chrono::steady_clock::time_point since;
  };
  static constexpr std::chrono::seconds kRetiredGrace{10};
  std::vector<Retired> retired;
  uint64_t retirements = 0;
  std::shared_ptr<Timer> retired_sweep;        // armed while `retired` is not empty
  std::unordered_set<ClusterClient*> clients;  // the worker's (each registers itself)
  std::function<void()> refresh;               // asks the control thread for the map again (any thread)
  size_t next_any = 0;                         // keyless commands are spread over the primaries
};

struct Worker {
  // `conns`: the process-wide registry of tenant connections (with tenancy), `detectors` the
  // process's shared detector state (nullptr: the worker's own); both outlive the worker.
  Worker(const config::ProxyConfig& c, config::ConfigStore& st, metrics::WorkerShard* s, tcp::endpoint up,
         tenant::Connections* conns = nullptr, hygiene::SharedDetectors* detectors = nullptr)
      : io(BOOST_ASIO_CONCURRENCY_HINT_UNSAFE_IO),
        config(c),
        shard(s),
        upstream(up),
        upstream_host(c.upstream.address.host),
        hygiene(c.hygiene, detectors),
        connections(conns),
        stages(c, st, s, conns) {}

  // Sockets and timers of a worker are used from its thread only, so the reactor's per-socket
  // locks are off (UNSAFE_IO); the scheduler's lock stays, as the control thread posts the drain
  // to this io_context and stops it.
  asio::io_context io;
  const config::ProxyConfig& config;  // settings fixed at start-up
  metrics::WorkerShard* shard;
  tcp::endpoint upstream;     // where new sessions connect (a Sentinel failover moves it)
  std::string upstream_host;  // its name, for TLS verification
  // A session could not connect, or a write got READONLY (Sentinel: ask for the primary again).
  std::function<void()> upstream_failed;
  std::shared_ptr<TlsClient> upstream_tls;  // with a TLS upstream (shared by every worker)
  std::shared_ptr<TlsClient> listen_tls;    // with listen_tls (shared by every worker)
  std::unordered_set<std::shared_ptr<Session>> sessions;
  // upstream_connections: shared. The pipelined connections new sessions are spread over, and
  // the idle connections pinned clients take.
  std::vector<std::shared_ptr<SharedLink>> links;
  // The write lanes' connections, one per link (SharedLink::partner), in the same order.
  std::vector<std::shared_ptr<SharedLink>> write_links;
  // Every shared link of the worker's upstream, read and write lanes: for what is done to all.
  template <typename F>
  void ForEachLink(F f) {
    for (auto& l : links) f(*l);
    for (auto& l : write_links) f(*l);
  }
  // A new shared link with its write lane's (started when `start`).
  void AddLink(bool resp3, bool start);
  std::unique_ptr<PinPool> pins;
  std::unique_ptr<PinPool> pins3;  // RESP3 clients' (Resp3Pins)
  // A Redis Cluster upstream (shared: each ClusterClient holds it, as sessions can end after the
  // worker's members at exit).
  std::shared_ptr<ClusterState> cluster;
  size_t next_link = 0;
  size_t next_link3 = 0;  // PickResp3Link
  // A RESP2 link (the first shared_connections of links), round robin.
  SharedLink* PickLink() { return links[next_link++ % static_cast<size_t>(config.shared_connections)].get(); }
  std::atomic<int> session_count{0};
  bool draining = false;
  hygiene::WorkerDetectors hygiene;  // the detectors' state shared by this worker's sessions (and the process's)
  hygiene::FindingLog* findings = nullptr;
  hygiene::HotKeys hot{config.hygiene};  // hot and big keys; published on hot_timer's ticks
  Timer hot_timer{io};
  Timer liveness_timer{io};          // Session::CheckUpstream, SharedLink::CheckLiveness, every second
  std::shared_ptr<SizeProbe> probe;  // with hygiene.probe
  tenant::Connections* connections;  // with tenancy: which tenant each upstream connection serves
  StageShared stages;                // what the command pipeline reads and counts (live settings, deny list)
  // keyguard's upstream AUTH, its password file read again when it changes (shared by every worker).
  std::shared_ptr<UpstreamCredentials> upstream_credentials;
  // Tenancy: each tenant's budget of key-walk steps on this worker (walk_steps_per_second, up to
  // one second's worth).
  std::unordered_map<const tenant::Tenant*, tenant::StepBudget> walk_budget;

  // keyguard_hygiene_actions_total by finding kind and action.
  metrics::Counter& HygieneActions(hygiene::Kind kind, hygiene::Action action) {
    return hygiene_action_handles.Get({kind, action}, [&]() -> metrics::Counter& {
      return shard->hygiene_actions.Get({hygiene::KindName(kind), hygiene::ActionName(action)});
    });
  }
  metrics::HandleCache<std::pair<hygiene::Kind, hygiene::Action>> hygiene_action_handles;
};

// A Redis Cluster upstream (cluster_client.cc). The worker routes by `map` from now on (its node
// links made as needed; those of nodes that left stay idle).
void AdoptClusterMap(Worker& worker, std::shared_ptr<const cluster::SlotMap> map);
// Retires the links of nodes in neither role of the worker's map that owe nothing, and frees the
// retired links no client holds any more (AdoptClusterMap calls it).
void RetireDepartedLinks(Worker& worker);
// Has every client let go of the retired links it holds with nothing in flight, frees those no
// client holds past their grace, and sweeps again after kRetiredGrace while any is left.
void FreeRetiredLinks(Worker& worker);
// The shared link of primary `index` of the worker's map (made and started on first use), or
// nullptr.
// `resp3`: of the set RESP3 clients use (its connections send HELLO 3).
SharedLink* ClusterNodeLink(Worker& worker, uint16_t index, bool resp3 = false);
// Where a client pinned for `slot` connects: its owner (kAnyNode: the first primary), or nullopt
// while no map is known.
std::optional<UpstreamAddress> ClusterNodeAddress(Worker& worker, int32_t slot);
// cluster.read_from: replica_preferred: a replica of the slot's primary whose link is up (in
// turn), else nullptr.
SharedLink* ClusterReplicaLink(Worker& worker, int32_t slot, bool resp3 = false);
// A MOVED a node sent (the caller counts it): the slot's owner is the node named, when the map has it
// as a primary, and the control thread is asked for the map.
void OnClusterMoved(Worker& worker, const cluster::Redirect& r);

// Counts a finding (keyguard_findings_total, keyguard_bigkey_access_total) and hands it to the
// finding log. `f` is complete: key, pattern, command, client and action filled.
void ReportFinding(Worker& worker, hygiene::Finding f);

}  // namespace keyguard::proxy
