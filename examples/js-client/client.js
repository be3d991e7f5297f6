#!/usr/bin/env node
"use strict";
// motor-js-client: a small JavaScript client of the Motor controller. It loads proto/ at run
// time with @grpc/proto-loader (no generated code), lists nodes and instances, applies a
// deployment written in protobuf JSON, and follows the controller's WatchEvents stream.
//
//   node client.js [--addr localhost:50051] [--json] nodes
//   node client.js [--addr ...] [--json] instances
//   node client.js [--addr ...] apply deployment.json
//   node client.js [--addr ...] [--json] watch [--until EVENT_TYPE_ENGINE_FAILED] [--count N]
//
// With TLS (docs/security.md): --cacert ca.crt, plus a client certificate (--cert, --key) or a
// bearer token (--token-file operator.token); without --cacert the connection is plaintext.

const fs = require("fs");
const path = require("path");
const { parseArgs } = require("util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const wkt = require("./wkt");

const USAGE = `usage: motor-js-client [options] COMMAND [ARGS]

commands:
  nodes                 list the nodes the controller knows (ListNodes)
  instances             list the instances and their engines (ListInstances)
  apply FILE.json       apply a deployment written in protobuf JSON (ApplyDeployment)
  watch                 print the snapshot, then every event (WatchEvents)
options:
  --addr HOST:PORT      controller address (env MOTOR_CONTROLLER, default localhost:50051)
  --proto-dir DIR       where motor/v1/*.proto live (env MOTOR_PROTO_DIR, default ../../proto)
  --json                print protobuf JSON, one message per line
  --timeout SECONDS     deadline of unary calls and of connecting (default 10)
  --until TYPE          watch: stop after the first event of TYPE (e.g. EVENT_TYPE_ENGINE_FAILED)
  --count N             watch: stop after N events
  --cacert FILE         CA bundle that signed the controller's certificate: connect with TLS
  --cert FILE, --key FILE  client certificate and key (with --cacert): identity from the certificate
  --token-file FILE     file holding a bearer token (with --cacert): identity from the token
`;

function fail(message) {
  process.stderr.write(`motor-js-client: ${message}\n`);
  process.exit(1);
}

// The gRPC status code name and message, which name what to fix.
function failRpc(call, error) {
  const code = Object.keys(grpc.status).find((name) => grpc.status[name] === error.code) || error.code;
  fail(`${call}: ${code}: ${error.details || error.message}`);
}

function readOrFail(file, option) {
  try {
    return fs.readFileSync(file);
  } catch (error) {
    return fail(`${option}: ${error.message}`);
  }
}

// Plaintext without a CA; TLS with one, plus a client certificate or a bearer token.
function channelCredentials(values) {
  if (!values.cacert) {
    if (values.cert || values["token-file"]) fail("--cert and --token-file need --cacert (the CA that signed the controller's certificate)");
    return grpc.credentials.createInsecure();
  }
  if (Boolean(values.cert) !== Boolean(values.key)) fail("--cert and --key go together");
  const tls = grpc.credentials.createSsl(
    readOrFail(values.cacert, "--cacert"),
    values.key ? readOrFail(values.key, "--key") : null,
    values.cert ? readOrFail(values.cert, "--cert") : null,
  );
  if (!values["token-file"]) return tls;
  const token = readOrFail(values["token-file"], "--token-file").toString().trim();
  const bearer = grpc.credentials.createFromMetadataGenerator((_, callback) => {
    const metadata = new grpc.Metadata();
    metadata.add("authorization", `Bearer ${token}`);
    callback(null, metadata);
  });
  return grpc.credentials.combineChannelCredentials(tls, bearer);
}

function loadApi(protoDir) {
  wkt.install();
  const definition = protoLoader.loadSync(["motor/v1/controller.proto"], {
    includeDirs: [protoDir],
    keepCase: true, // the .proto field names, as in grpcurl's and the Go client's JSON
    longs: String, // 64-bit integers as strings, as in canonical protobuf JSON
    enums: String,
    defaults: false,
    oneofs: false,
    json: true,
  });
  return { api: grpc.loadPackageDefinition(definition).motor.v1, definition };
}

function table(header, rows) {
  const widths = header.map((title, i) => Math.max(title.length, ...rows.map((row) => String(row[i]).length)));
  const line = (cells) => cells.map((cell, i) => String(cell).padEnd(widths[i])).join("  ").trimEnd();
  return [line(header), ...rows.map(line)].join("\n");
}

const short = (name, prefix) => String(name || "").replace(prefix, "");

function unary(client, method, request, timeoutSeconds) {
  const deadline = new Date(Date.now() + timeoutSeconds * 1000);
  return new Promise((resolve) => {
    client[method](request, { deadline }, (error, response) => {
      if (error) failRpc(method, error);
      resolve(response);
    });
  });
}

async function listNodes(client, options) {
  const response = await unary(client, "ListNodes", {}, options.timeout);
  if (options.json) return console.log(JSON.stringify(response));
  const rows = (response.nodes || []).map((node) => [
    node.info.node_id, short(node.state, "NODE_STATE_"), node.info.address || "",
    (node.engines || []).length, node.state_reason || "",
  ]);
  console.log(table(["NODE", "STATE", "ADDRESS", "ENGINES", "REASON"], rows));
  for (const alarm of response.alarms || []) console.log(`ALARM: ${alarm}`);
}

async function listInstances(client, options) {
  const response = await unary(client, "ListInstances", {}, options.timeout);
  if (options.json) return console.log(JSON.stringify(response));
  const rows = [];
  for (const instance of response.instances || []) {
    for (const engine of instance.engines || []) {
      rows.push([
        instance.instance_id, short(instance.role, "ROLE_"), short(instance.state, "INSTANCE_STATE_"),
        engine.engine_id, engine.node_id || "", engine.port || 0, short(engine.health, "HEALTH_STATUS_"),
        engine.restarts || 0,
      ]);
    }
  }
  console.log(table(["INSTANCE", "ROLE", "STATE", "ENGINE", "NODE", "PORT", "HEALTH", "RESTARTS"], rows));
}

async function apply(client, definition, options, file) {
  let deployment;
  try {
    deployment = JSON.parse(fs.readFileSync(file, "utf8"));
  } catch (error) {
    fail(`cannot read the deployment ${file}: ${error.message}`);
  }
  try {
    deployment = wkt.fromJson(definition, "motor.v1.Deployment", deployment, "deployment");
  } catch (error) {
    fail(`${file} is not a motor.v1.Deployment in protobuf JSON: ${error.message}`);
  }
  const response = await unary(client, "ApplyDeployment", { deployment }, options.timeout);
  console.log(`applied deployment "${response.deployment.name}", revision ${response.revision || 0}`);
}

function watch(client, options) {
  const stream = client.WatchEvents({});
  let seen = 0;
  stream.on("data", (message) => {
    if (options.json) {
      console.log(JSON.stringify(message));
    } else if (message.snapshot) {
      const snapshot = message.snapshot;
      console.log(`snapshot: ${(snapshot.nodes || []).length} nodes, ${(snapshot.instances || []).length} instances, ` +
        `${(snapshot.recent_events || []).length} recent events`);
    } else if (message.event) {
      const event = message.event;
      console.log(`#${event.sequence} ${event.time} ${short(event.type, "EVENT_TYPE_")} ${event.message || ""}`);
    }
    if (message.event) {
      seen += 1;
      if (message.event.type === options.until || (options.count > 0 && seen >= options.count)) {
        stream.cancel();
        process.exit(0);
      }
    }
  });
  stream.on("error", (error) => failRpc("WatchEvents", error));
  stream.on("end", () => process.exit(0));
}

async function main() {
  let parsed;
  try {
    parsed = parseArgs({
      allowPositionals: true,
      options: {
        addr: { type: "string", default: process.env.MOTOR_CONTROLLER || "localhost:50051" },
        "proto-dir": { type: "string", default: process.env.MOTOR_PROTO_DIR || path.join(__dirname, "..", "..", "proto") },
        json: { type: "boolean", default: false },
        timeout: { type: "string", default: "10" },
        until: { type: "string", default: "" },
        count: { type: "string", default: "0" },
        cacert: { type: "string", default: "" },
        cert: { type: "string", default: "" },
        key: { type: "string", default: "" },
        "token-file": { type: "string", default: "" },
        help: { type: "boolean", short: "h", default: false },
      },
    });
  } catch (error) {
    fail(`${error.message}\n${USAGE}`);
  }
  const { values, positionals } = parsed;
  if (values.help || positionals.length === 0) {
    process.stderr.write(USAGE);
    process.exit(values.help ? 0 : 2);
  }
  const options = { json: values.json, timeout: Number(values.timeout), until: values.until, count: Number(values.count) };
  if (!(options.timeout > 0)) fail(`--timeout: expected a number of seconds, got ${JSON.stringify(values.timeout)}`);

  const [command, ...args] = positionals;
  if (!["nodes", "instances", "apply", "watch"].includes(command)) {
    fail(`unknown command ${JSON.stringify(command)} (nodes, instances, apply, watch)`);
  }
  if (command === "apply" && args.length !== 1) fail("apply needs exactly one argument: the deployment JSON file");

  const { api, definition } = loadApi(values["proto-dir"]);
  if (options.until && !definition["motor.v1.EventType"].type.value.some((v) => v.name === options.until)) {
    fail(`--until: unknown event type ${JSON.stringify(options.until)} (e.g. EVENT_TYPE_ENGINE_FAILED)`);
  }
  const client = new api.ControllerService(values.addr, channelCredentials(values));
  await new Promise((resolve) => {
    client.waitForReady(new Date(Date.now() + options.timeout * 1000), (error) => {
      if (error) fail(`cannot connect to the controller at ${values.addr}: ${error.message}`);
      resolve();
    });
  });

  switch (command) {
    case "nodes":
      await listNodes(client, options);
      break;
    case "instances":
      await listInstances(client, options);
      break;
    case "apply":
      await apply(client, definition, options, args[0]);
      break;
    case "watch":
      return watch(client, options); // runs until --until/--count or the stream ends
  }
  client.close();
}

main();
