'use strict';
// KServe ModelStreamInfer from grpc-js (Node's own HTTP/2 stack, not grpcio's), run by
// tests/integration/test_clients.py. The service's descriptors come from the test as a
// serialized FileDescriptorSet (tritonclient ships no .proto files).
//
//   node kserve_stream.js DESCRIPTORS TARGET API_KEY COUNT
//
// Sends COUNT identity requests and one for a model that does not exist on one stream,
// half-closes, and prints what came back as JSON: {responses: [{id, error, values}], status}.

const fs = require('node:fs');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [descriptors, target, apiKey, count] = process.argv.slice(2);
const definition = protoLoader.loadFileDescriptorSetFromBuffer(fs.readFileSync(descriptors), {
  keepCase: true,
  longs: String,
  defaults: true,
});
const { inference } = grpc.loadPackageDefinition(definition);
const client = new inference.GRPCInferenceService(target, grpc.credentials.createInsecure());
const metadata = new grpc.Metadata();
metadata.set('authorization', `Bearer ${apiKey}`);

const call = client.ModelStreamInfer(metadata, { deadline: Date.now() + 60_000 });
const responses = [];
call.on('data', (reply) => {
  const raw = reply.infer_response.raw_output_contents[0];
  const values = raw ? Array.from({ length: raw.length / 4 }, (_, i) => raw.readFloatLE(4 * i)) : [];
  responses.push({ id: reply.infer_response.id, error: reply.error_message, values });
});
call.on('error', (error) => {
  console.log(JSON.stringify({ responses, status: error.code, details: error.details }));
});
call.on('status', (status) => {
  if (status.code === grpc.status.OK) console.log(JSON.stringify({ responses, status: status.code }));
});

for (let n = 0; n < Number(count); n += 1) {
  const values = Buffer.alloc(16);
  [n, n + 0.5, -n, 1e6].forEach((v, i) => values.writeFloatLE(v, 4 * i));
  call.write({
    model_name: 'identity',
    id: `node-${n}`,
    inputs: [{ name: 'INPUT0', datatype: 'FP32', shape: [1, 4] }],
    raw_input_contents: [values],
  });
}
call.write({ model_name: 'no-such-model', id: 'node-missing' });
call.end();
