// ioredis's Cluster client through keyguard, logged in as one tenant: prints what it saw as one
// JSON object for tests/integration/test_every_mode.py to assert.
// usage: node cluster_tenant.js PORT USER PASSWORD
const Redis = require("ioredis");

async function main() {
  const [port, username, password] = process.argv.slice(2);
  const c = new Redis.Cluster([{ host: "127.0.0.1", port: Number(port) }], {
    redisOptions: { username, password },
    enableReadyCheck: true,
    clusterRetryStrategy: () => null,
  });
  const out = {};
  try {
    await new Promise((resolve, reject) => {
      c.once("ready", resolve);
      c.once("error", reject);
    });
    out.nodes = c.nodes("all").map((n) => `${n.options.host}:${n.options.port}`);
    const keys = [];
    for (let i = 0; i < 40; i++) keys.push(`io:${i}`);
    out.sets = [];
    for (const k of keys) out.sets.push(await c.set(k, `v-${k}`));
    out.gets = [];
    for (const k of keys) out.gets.push(await c.get(k));
    // One slot's keys in a pipeline and in MGET (ioredis sends a pipeline to one node).
    out.pipeline = await c.pipeline().set("{io}a", "1").incr("{io}n").get("{io}a").exec();
    out.mget = await c.mget("{io}a", "{io}b");
    out.hash = [await c.hset("io:h", "f", "1", "g", "2"), await c.hgetall("io:h")];
    out.multi = await c.multi().incr("{io}n").get("{io}n").exec();
    out.dbsize = await c.dbsize();
  } catch (e) {
    out.error = String(e && e.message ? e.message : e);
  } finally {
    c.disconnect();
  }
  process.stdout.write(JSON.stringify(out) + "\n");
}

main();
