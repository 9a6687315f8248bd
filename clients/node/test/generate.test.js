'use strict';
// Streams a generation through a running gateway. QOSGATE_TARGET, QOSGATE_API_KEY and
// QOSGATE_MODEL come from the environment (tests/integration/test_node_client.py starts
// Triton and the gateway and sets them); without a target the test is skipped.

const test = require('node:test');
const assert = require('node:assert/strict');
const grpc = require('@grpc/grpc-js');
const { QosgateClient, qosgateV1 } = require('../qosgate.js');

const target = process.env.QOSGATE_TARGET;
const apiKey = process.env.QOSGATE_API_KEY;
const model = process.env.QOSGATE_MODEL || 'smollm2';

test('the protos load and expose every service', () => {
  const v1 = qosgateV1();
  for (const service of ['GenerationService', 'EmbeddingService', 'AdminService', 'BatchService']) {
    assert.equal(typeof v1[service], 'function', service);
  }
});

test('GenerateStream streams text deltas and ends with usage', { skip: !target && 'QOSGATE_TARGET not set' }, async () => {
  const client = new QosgateClient(target, apiKey);
  try {
    const call = client.generateStream({
      model,
      chat: { messages: [{ role: 'ROLE_USER', content: 'What is the capital of France?' }] },
      sampling: { max_tokens: 24, temperature: 0 },
    });
    const messages = [];
    for await (const message of call) messages.push(message);
    assert.ok(messages.length >= 2, `expected several stream messages, got ${messages.length}`);
    const last = messages[messages.length - 1];
    assert.ok(['FINISH_REASON_STOP', 'FINISH_REASON_LENGTH'].includes(last.finish_reason), last.finish_reason);
    const text = messages.map((m) => m.text).join('');
    assert.ok(text.trim().length > 0, 'no text generated');
    assert.ok(last.usage.completion_tokens > 0 && last.usage.completion_tokens <= 24);
    assert.ok(last.usage.prompt_tokens > 0);
  } finally {
    client.close();
  }
});

test('a call without a key is refused UNAUTHENTICATED', { skip: !target && 'QOSGATE_TARGET not set' }, async () => {
  const client = new QosgateClient(target, '');
  try {
    await assert.rejects(client.generate({ model, prompt: 'hi' }), (error) => error.code === grpc.status.UNAUTHENTICATED);
  } finally {
    client.close();
  }
});
