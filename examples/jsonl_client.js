// A non-Python router driving `selection-proto stdio` over JSON lines (JSON-RPC 2.0).
// Usage: node examples/jsonl_client.js [python]   (default: the active virtualenv's, else python3)
"use strict";
const { spawn } = require("child_process");
const path = require("path");
const readline = require("readline");

const python = process.argv[2] ||
  (process.env.VIRTUAL_ENV ? path.join(process.env.VIRTUAL_ENV, "bin", "python") : "python3");
const child = spawn(python, ["-m", "selection_proto", "stdio", "--kv-events", "push"], {
  stdio: ["pipe", "pipe", "inherit"],
});
const waiting = new Map();
let nextId = 1;
let finished = false;

// The service ending before we are done is a failure, whatever its exit code says.
child.on("error", (err) => {
  console.error(`cannot start ${python}: ${err.message}`);
  process.exit(1);
});
child.on("exit", (code, signal) => {
  if (!finished || code !== 0) {
    console.error(`selection-proto stdio ended (code ${code}, signal ${signal})`);
    process.exit(code ? code : 1);
  }
  process.exit(0);
});

child.stdin.on("error", () => {});  // EPIPE once the service has died: its exit says why

readline.createInterface({ input: child.stdout }).on("line", (line) => {
  const message = JSON.parse(line);
  const done = waiting.get(message.id);
  waiting.delete(message.id);
  if (done) done(message);
});

function call(method, params) {
  const id = nextId++;
  child.stdin.write(JSON.stringify({ jsonrpc: "2.0", id, method, params }) + "\n");
  return new Promise((resolve) => waiting.set(id, resolve));
}

(async () => {
  await call("workers.create", { worker_id: 1, model_name: "m", endpoint: "http://w1", block_size: 4 });
  await call("workers.create", { worker_id: 2, model_name: "m", endpoint: "http://w2", block_size: 4 });
  const picked = await call("select_and_reserve", { model_name: "m", token_ids: [1, 2, 3, 4, 5, 6, 7, 8], reservation_id: "js-1" });
  const missing = await call("workers.delete", { worker_id: 99 });
  await call("reservations.free", { reservation_id: "js-1" });
  console.log(JSON.stringify({ worker_id: picked.result.worker_id, error_code: missing.error.code }));
  finished = true;
  child.stdin.end();  // EOF: the service answers what is in flight and exits 0
})();
