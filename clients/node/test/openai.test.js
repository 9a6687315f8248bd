'use strict';
// The gateway's OpenAI-compatible HTTP API through the official `openai` npm package.
// QOSGATE_OPENAI_BASE_URL (http://host:port/v1) and QOSGATE_API_KEY come from the
// environment (tests/integration/test_clients.py sets them); without them it is skipped.

const test = require('node:test');
const assert = require('node:assert/strict');
const { OpenAI } = require('openai');

const baseURL = process.env.QOSGATE_OPENAI_BASE_URL;
const apiKey = process.env.QOSGATE_API_KEY;
const skip = !baseURL && 'QOSGATE_OPENAI_BASE_URL not set';

test('chat completions stream the answer and end with usage', { skip }, async () => {
  const client = new OpenAI({ baseURL, apiKey });
  const stream = await client.chat.completions.create({
    model: 'smollm2',
    messages: [{ role: 'user', content: 'What is the capital of France?' }],
    max_tokens: 32,
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = '';
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length) text += chunk.choices[0].delta.content || '';
    if (chunk.usage) usage = chunk.usage;
  }
  assert.match(text, /Paris/);
  assert.ok(usage.prompt_tokens > 0 && usage.completion_tokens > 0 && usage.completion_tokens <= 32);
});

test('embeddings are 384-dimensional', { skip }, async () => {
  const client = new OpenAI({ baseURL, apiKey });
  const reply = await client.embeddings.create({ model: 'minilm', input: ['a cat', 'a dog'] });
  assert.deepEqual(reply.data.map((e) => e.embedding.length), [384, 384]);
});

test('models lists the tenant\'s models and a bad key is a 401', { skip }, async () => {
  const models = [];
  for await (const model of new OpenAI({ baseURL, apiKey }).models.list()) models.push(model.id);
  assert.ok(models.includes('smollm2') && models.includes('minilm'), models.join(','));
  const stranger = new OpenAI({ baseURL, apiKey: 'not-a-key', maxRetries: 0 });
  await assert.rejects(stranger.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
});
