'use strict';
// A small Node.js client for the qosgate.v1 API. The .proto files are loaded at run time
// from protos/ in this repository, so there is no generated code to keep in sync.

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTOS = path.resolve(__dirname, '..', '..', 'protos');
const FILES = ['generation', 'embedding', 'admin', 'batch'].map((f) => `qosgate/v1/${f}.proto`);

// keepCase: field names as in the .proto (max_tokens), the same spelling as the docs;
// enums as their names ('FINISH_REASON_STOP'); 64-bit integers as strings (no precision loss).
const LOAD_OPTIONS = { keepCase: true, enums: String, longs: String, defaults: true, oneofs: true, includeDirs: [PROTOS] };

let cachedPackage;
function qosgateV1() {
  if (!cachedPackage) {
    const definition = protoLoader.loadSync(FILES, LOAD_OPTIONS);
    cachedPackage = grpc.loadPackageDefinition(definition).qosgate.v1;
  }
  return cachedPackage;
}

/** Turns a callback-style unary call into a promise. */
function unary(stub, method, request, metadata) {
  return new Promise((resolve, reject) => {
    stub[method](request, metadata, (error, response) => (error ? reject(error) : resolve(response)));
  });
}

/**
 * TLS credentials for a gateway with `tls:` set: `ca` (PEM file of the CA to verify it
 * with; default: the system roots), and for mutual TLS `cert` and `key` (PEM files of
 * the client certificate and its key). Pass the result as QosgateClient's `credentials`.
 */
function tlsCredentials({ ca, cert, key } = {}) {
  if (Boolean(cert) !== Boolean(key)) throw new Error('give both a client certificate and its key, or neither');
  const read = (file) => (file ? fs.readFileSync(file) : null);
  return grpc.credentials.createSsl(read(ca), read(key), read(cert));
}

/**
 * A connection to a gateway for one tenant.
 * `target` is host:port; `apiKey` is sent as `authorization: Bearer <key>` on every call
 * (leave it out when a client certificate identifies the tenant).
 */
class QosgateClient {
  constructor(target, apiKey, credentials = grpc.credentials.createInsecure()) {
    const v1 = qosgateV1();
    this.metadata = new grpc.Metadata();
    if (apiKey) this.metadata.set('authorization', `Bearer ${apiKey}`);
    this.generation = new v1.GenerationService(target, credentials);
    this.embedding = new v1.EmbeddingService(target, credentials, { channelOverride: this.generation.getChannel() });
    this.admin = new v1.AdminService(target, credentials, { channelOverride: this.generation.getChannel() });
  }

  /** Resolves to a GenerateResponse: { text, finish_reason, usage, timing }. */
  generate(request) {
    return unary(this.generation, 'Generate', request, this.metadata);
  }

  /**
   * Returns the call: a readable stream of GenerateStreamResponse messages ('data'
   * events; the last carries finish_reason, usage, timing). call.cancel() stops generation.
   */
  generateStream(request) {
    return this.generation.GenerateStream(request, this.metadata);
  }

  /** Resolves to an EmbedResponse: { embeddings: [{ values }], timing }. */
  embed(request) {
    return unary(this.embedding, 'Embed', request, this.metadata);
  }

  /** Resolves to a GetUsageResponse for the caller (or `tenant`, with an admin key). */
  usage(tenant = '') {
    return unary(this.admin, 'GetUsage', { tenant }, this.metadata);
  }

  close() {
    this.generation.close();
  }
}

module.exports = { QosgateClient, qosgateV1, tlsCredentials };
