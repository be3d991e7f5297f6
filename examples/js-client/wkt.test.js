"use strict";
// node --test: the canonical JSON of Duration, Timestamp and Struct, through proto-loader's own
// serializer and deserializer (the path every request and response of the client takes).
const test = require("node:test");
const assert = require("node:assert");
const path = require("path");
const protoLoader = require("@grpc/proto-loader");
const wkt = require("./wkt");

wkt.install();
const definition = protoLoader.loadSync(["motor/v1/controller.proto"], {
  includeDirs: [path.join(__dirname, "..", "..", "proto")],
  keepCase: true, longs: String, enums: String, defaults: false, oneofs: false, json: true,
});
const roundTrip = (type, object) =>
  definition[type].deserialize(definition[type].serialize(wkt.fromJson(definition, type, object, "request")));

test("durations as strings, fractions kept", () => {
  const policy = roundTrip("motor.v1.RestartPolicy", { initial_backoff: "1.5s", max_backoff: "60s", reset_after: "0.000000001s" });
  assert.deepStrictEqual(policy, { initial_backoff: "1.500s", max_backoff: "60s", reset_after: "0.000000001s" });
  assert.throws(() => roundTrip("motor.v1.RestartPolicy", { initial_backoff: "1 minute" }), /invalid duration "1 minute"/);
});

test("timestamps in RFC 3339 with nanoseconds", () => {
  const event = roundTrip("motor.v1.Event", { sequence: "7", time: "2026-11-22T02:40:12.123456789Z" });
  assert.deepStrictEqual(event, { sequence: "7", time: "2026-11-22T02:40:12.123456789Z" });
  assert.strictEqual(roundTrip("motor.v1.Event", { time: "2026-01-02T03:04:05Z" }).time, "2026-01-02T03:04:05Z");
});

test("Struct as a plain JSON object", () => {
  const config = { a: { engine_type: "sim", n: 3, on: true, none: null, list: [1, "x", { y: false }] } };
  const deployment = roundTrip("motor.v1.Deployment", { name: "d", engine_config: config });
  assert.deepStrictEqual(deployment, { name: "d", engine_config: config });
});

test("unknown fields and enum values are named, not dropped", () => {
  assert.throws(() => roundTrip("motor.v1.Deployment", { name: "d", instanceGroups: [] }),
    /request.instanceGroups: unknown field of motor.v1.Deployment \(write it as "instance_groups"\)/);
  assert.throws(() => roundTrip("motor.v1.Deployment", { instance_groups: [{ name: "p", role: "ROLE_PREFIL" }] }),
    /request.instance_groups\[0\].role: unknown value "ROLE_PREFIL"/);
  const groups = roundTrip("motor.v1.Deployment", { instance_groups: [{ name: "p", role: "ROLE_PREFILL", count: 2 }] });
  assert.deepStrictEqual(groups, { instance_groups: [{ name: "p", role: "ROLE_PREFILL", count: 2 }] });
});

test("the example deployment survives the round trip unchanged", () => {
  const file = path.join(__dirname, "..", "go-client", "local-deployment.json");
  const deployment = JSON.parse(require("fs").readFileSync(file, "utf8"));
  assert.deepStrictEqual(roundTrip("motor.v1.Deployment", deployment), deployment);
});
