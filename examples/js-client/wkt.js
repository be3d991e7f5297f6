"use strict";
// Canonical protobuf JSON for the well-known types Motor's API uses (Duration, Timestamp,
// Struct/Value/ListValue), so that this client reads and prints the same JSON as grpcurl, Go's
// protojson and Python's json_format ("1.5s", "2026-01-02T03:04:05Z", plain JSON objects).
// protobufjs only maps google.protobuf.Any by itself; these wrappers are installed into the same
// protobufjs instance that @grpc/proto-loader uses, so they apply to every request and response.

const protobuf = require("protobufjs");

function has(message, name) {
  return Object.prototype.hasOwnProperty.call(message, name);
}

function toNumber(value) {
  return typeof value === "number" ? value : Number(String(value)); // Long, string or number
}

// "1.5s" -> {seconds: 1, nanos: 500000000}; signs of seconds and nanos agree.
function parseDuration(text) {
  const match = /^(-)?(\d+)(?:\.(\d{1,9}))?s$/.exec(text);
  if (!match) throw new TypeError(`invalid duration ${JSON.stringify(text)}: expected e.g. "1s" or "0.5s"`);
  const sign = match[1] ? -1 : 1;
  const nanos = match[3] ? Number(match[3].padEnd(9, "0")) : 0;
  return { seconds: sign * Number(match[2]), nanos: sign * nanos };
}

// 0, 3, 6 or 9 fractional digits, as protobuf's canonical JSON writes them.
function fraction(nanos) {
  if (nanos === 0) return "";
  let digits = String(nanos).padStart(9, "0");
  while (digits.length > 3 && digits.endsWith("000")) digits = digits.slice(0, -3);
  return "." + digits;
}

function formatDuration(seconds, nanos) {
  const negative = seconds < 0 || nanos < 0;
  return (negative ? "-" : "") + Math.abs(seconds) + fraction(Math.abs(nanos)) + "s";
}

// RFC 3339 -> {seconds, nanos}, keeping the nanoseconds that Date would drop.
function parseTimestamp(text) {
  const match = /^(.*T\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$/.exec(text);
  const millis = match ? Date.parse(match[1] + match[3]) : NaN;
  if (Number.isNaN(millis)) throw new TypeError(`invalid timestamp ${JSON.stringify(text)}: expected RFC 3339`);
  return { seconds: Math.floor(millis / 1000), nanos: match[2] ? Number(match[2].padEnd(9, "0")) : 0 };
}

function formatTimestamp(seconds, nanos) {
  const base = new Date(seconds * 1000).toISOString().replace(/\.\d{3}Z$/, "");
  return base + fraction(nanos) + "Z";
}

const wrappers = {
  ".google.protobuf.Duration": {
    fromObject(object) {
      if (object instanceof this.ctor) return object;
      return this.fromObject(typeof object === "string" ? parseDuration(object) : object);
    },
    toObject(message, options) {
      if (!(options && options.json)) return this.toObject(message, options);
      return formatDuration(toNumber(message.seconds || 0), message.nanos || 0);
    },
  },
  ".google.protobuf.Timestamp": {
    fromObject(object) {
      if (object instanceof this.ctor) return object;
      return this.fromObject(typeof object === "string" ? parseTimestamp(object) : object);
    },
    toObject(message, options) {
      if (!(options && options.json)) return this.toObject(message, options);
      return formatTimestamp(toNumber(message.seconds || 0), message.nanos || 0);
    },
  },
  // Struct <-> a plain JSON object.
  ".google.protobuf.Struct": {
    fromObject(object) {
      if (object instanceof this.ctor) return object;
      const valueType = this.lookupType(".google.protobuf.Value");
      const fields = {};
      for (const [key, value] of Object.entries(object || {})) fields[key] = valueType.fromObject(value);
      return this.fromObject({ fields });
    },
    toObject(message, options) {
      if (!(options && options.json)) return this.toObject(message, options);
      const valueType = this.lookupType(".google.protobuf.Value");
      const result = {};
      for (const [key, value] of Object.entries(message.fields || {})) result[key] = valueType.toObject(value, options);
      return result;
    },
  },
  // Value <-> any JSON value.
  ".google.protobuf.Value": {
    fromObject(object) {
      if (object instanceof this.ctor) return object;
      if (object === null || object === undefined) return this.fromObject({ null_value: 0, nullValue: 0 });
      if (typeof object === "number") return this.fromObject({ number_value: object, numberValue: object });
      if (typeof object === "string") return this.fromObject({ string_value: object, stringValue: object });
      if (typeof object === "boolean") return this.fromObject({ bool_value: object, boolValue: object });
      if (Array.isArray(object)) {
        const list = this.lookupType(".google.protobuf.ListValue").fromObject(object);
        return this.fromObject({ list_value: list, listValue: list });
      }
      const struct = this.lookupType(".google.protobuf.Struct").fromObject(object);
      return this.fromObject({ struct_value: struct, structValue: struct });
    },
    toObject(message, options) {
      if (!(options && options.json)) return this.toObject(message, options);
      for (const name of ["number_value", "numberValue"]) if (has(message, name)) return message[name];
      for (const name of ["string_value", "stringValue"]) if (has(message, name)) return message[name];
      for (const name of ["bool_value", "boolValue"]) if (has(message, name)) return message[name];
      for (const name of ["struct_value", "structValue"])
        if (has(message, name)) return this.lookupType(".google.protobuf.Struct").toObject(message[name], options);
      for (const name of ["list_value", "listValue"])
        if (has(message, name)) return this.lookupType(".google.protobuf.ListValue").toObject(message[name], options);
      return null;
    },
  },
  ".google.protobuf.ListValue": {
    fromObject(object) {
      if (object instanceof this.ctor) return object;
      const valueType = this.lookupType(".google.protobuf.Value");
      return this.fromObject({ values: (object || []).map((value) => valueType.fromObject(value)) });
    },
    toObject(message, options) {
      if (!(options && options.json)) return this.toObject(message, options);
      const valueType = this.lookupType(".google.protobuf.Value");
      return (message.values || []).map((value) => valueType.toObject(value, options));
    },
  },
};

// Protobuf JSON -> the object form proto-loader serializes, checked against the schema
// (`definition` from protoLoader.loadSync with keepCase). protobufjs silently drops unknown
// fields and enum names, and refuses a string where Duration/Timestamp expect an object before
// any wrapper runs; this names the field to fix instead ("deployment.instance_groups[0].role:
// unknown value ...") and turns "1s" / RFC 3339 strings into {seconds, nanos}.
function fromJson(definition, typeName, object, where) {
  if (typeName === "google.protobuf.Duration" && typeof object === "string") return parseDuration(object);
  if (typeName === "google.protobuf.Timestamp" && typeof object === "string") return parseTimestamp(object);
  if (typeName.startsWith("google.protobuf.")) return object; // Struct/Value: any JSON, see the wrappers
  if (object === null || typeof object !== "object" || Array.isArray(object)) {
    throw new TypeError(`${where}: expected a JSON object (a ${typeName})`);
  }
  const fields = definition[typeName].type.field;
  const result = {};
  for (const [key, value] of Object.entries(object)) {
    const field = fields.find((candidate) => candidate.name === key);
    if (!field) {
      const camel = fields.find((candidate) => candidate.name.replace(/_(.)/g, (_, c) => c.toUpperCase()) === key);
      throw new TypeError(`${where}.${key}: unknown field of ${typeName}` + (camel ? ` (write it as "${camel.name}")` : ""));
    }
    const repeated = field.label === "LABEL_REPEATED";
    if (repeated && !Array.isArray(value)) throw new TypeError(`${where}.${key}: expected a JSON array`);
    const fieldType = field.typeName.includes(".") ? field.typeName : `motor.v1.${field.typeName}`;
    const convert = (item, at) => {
      if (field.type === "TYPE_MESSAGE") return fromJson(definition, fieldType, item, at);
      if (field.type === "TYPE_ENUM" && typeof item !== "number") {
        const names = definition[fieldType].type.value.map((v) => v.name);
        if (!names.includes(item)) throw new TypeError(`${at}: unknown value ${JSON.stringify(item)} (one of ${names.join(", ")})`);
      }
      return item;
    };
    result[key] = repeated ? value.map((item, i) => convert(item, `${where}.${key}[${i}]`)) : convert(value, `${where}.${key}`);
  }
  return result;
}

// Must run before the first message of these types is encoded or decoded (types set up lazily).
function install() {
  Object.assign(protobuf.wrappers, wrappers);
}

module.exports = { install, fromJson, parseDuration, formatDuration, parseTimestamp, formatTimestamp };
