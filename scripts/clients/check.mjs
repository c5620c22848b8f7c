// Client libraries no one here wrote, unchanged, against an infernode cluster: the
// Vercel AI SDK's default OpenAI provider (the Responses API) and its Open Responses
// provider (the open specification of that API), the official OpenAI SDK's
// responses.create with previous_response_id, and LangChain's withStructuredOutput and
// bindTools (chat completions). Usage: node check.mjs URL [URL...] (a node's base URL
// each; requests rotate over them). Exits non-zero on the first failed check.
import assert from "node:assert/strict";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenResponses } from "@ai-sdk/open-responses";
import { generateText, streamText, generateObject, tool, stepCountIs } from "ai";
import OpenAI from "openai";
import { ChatOpenAI } from "@langchain/openai";
import { z } from "zod";

const urls = process.argv.slice(2);
if (urls.length === 0) {
  console.error("usage: node check.mjs URL [URL...]");
  process.exit(2);
}
const model = process.env.MODEL ?? "stories260K";
const apiKey = process.env.API_KEY ?? "none";
let turn = 0;
const next = () => urls[turn++ % urls.length] + "/v1";

let passed = 0, failed = 0;
async function check(name, fn) {
  const start = Date.now();
  try {
    await fn();
    passed++;
    console.log(`ok   ${name} (${Date.now() - start} ms)`);
  } catch (err) {
    failed++;
    console.log(`FAIL ${name}: ${err?.stack ?? err}`);
  }
}

// A provider per request, so consecutive calls enter at different nodes.
const vercel = () => createOpenAI({ baseURL: next(), apiKey })(model);
const weather = tool({
  description: "Get the weather in a city",
  inputSchema: z.object({ city: z.string().max(12) }),
  execute: async ({ city }) => ({ city, forecast: "sunny", celsius: 21 }),
});

await check("ai-sdk generateText (responses)", async () => {
  const r = await generateText({ model: vercel(), prompt: "Once upon a time", maxOutputTokens: 16, temperature: 0 });
  assert.ok(r.text.length > 0, "empty text");
  assert.ok(r.usage.outputTokens > 0);
});

await check("ai-sdk streamText (responses)", async () => {
  const r = streamText({ model: vercel(), prompt: "Tom had a dog.", maxOutputTokens: 16, temperature: 0 });
  let text = "";
  for await (const piece of r.textStream) text += piece;
  assert.ok(text.length > 0, "empty stream");
  assert.equal(text, await r.text);
  assert.ok(["stop", "length"].includes(await r.finishReason), `finish ${await r.finishReason}`);
});

await check("ai-sdk generateObject with a schema (responses, text.format)", async () => {
  // Bounded strings: a model this small may otherwise write one until max tokens.
  const schema = z.object({ name: z.string().max(12), age: z.number().int(), pets: z.array(z.string().max(12)).max(3) });
  const r = await generateObject({ model: vercel(), schema, prompt: "Describe a girl and her pets.", maxOutputTokens: 200, temperature: 0 });
  schema.parse(r.object);
});

await check("ai-sdk tool calls over several steps (responses)", async () => {
  const r = await generateText({
    model: vercel(), tools: { weather }, toolChoice: "required", stopWhen: stepCountIs(2), maxOutputTokens: 100, temperature: 0,
    prompt: "What is the weather in Paris?", providerOptions: { openai: { parallelToolCalls: false } },
  });
  const calls = r.steps.flatMap((s) => s.toolCalls);
  assert.ok(calls.length >= 1, "no tool call");
  assert.equal(calls[0].toolName, "weather");
  assert.equal(typeof calls[0].input.city, "string");
  assert.ok(r.steps.length >= 2, `only ${r.steps.length} step(s)`);
  assert.ok(r.steps[0].toolResults.length >= 1, "no tool result");
});

await check("ai-sdk multi-turn with stored items (item_reference)", async () => {
  const first = await generateText({ model: vercel(), prompt: "Lily saw a cat.", maxOutputTokens: 12, temperature: 0 });
  const bodies = []; // what the SDK sends: the earlier answer as a reference, not as text
  const recording = createOpenAI({ baseURL: next(), apiKey, fetch: (url, init) => (bodies.push(init.body), fetch(url, init)) })(model);
  const second = await generateText({
    model: recording, maxOutputTokens: 12, temperature: 0,
    messages: [{ role: "user", content: "Lily saw a cat." }, ...first.response.messages, { role: "user", content: "What did she do?" }],
  });
  assert.ok(second.text.length > 0);
  assert.ok(bodies.some((b) => String(b).includes('"item_reference"')), "the SDK sent no item_reference");
});

await check("openai responses.create with previous_response_id, across nodes", async () => {
  let prev;
  for (let i = 0; i < 3; i++) {
    const client = new OpenAI({ baseURL: next(), apiKey });
    const r = await client.responses.create({
      model, input: ["Ben found a ball.", "Then what?", "And after that?"][i], max_output_tokens: 12, temperature: 0,
      ...(prev && { previous_response_id: prev.id }),
    });
    assert.equal(r.object, "response");
    assert.ok(r.output_text.length > 0, "empty output_text");
    if (prev) {
      assert.equal(r.previous_response_id, prev.id);
      assert.ok(r.usage.input_tokens_details.cached_tokens > 0, `turn ${i + 1} cold`);
    }
    const got = await new OpenAI({ baseURL: next(), apiKey }).responses.retrieve(r.id);
    assert.equal(got.id, r.id);
    prev = r;
  }
  const client = new OpenAI({ baseURL: next(), apiKey });
  await client.responses.delete(prev.id);
  await assert.rejects(client.responses.retrieve(prev.id), /404/);
});

await check("openai responses.create streaming", async () => {
  const client = new OpenAI({ baseURL: next(), apiKey });
  const stream = await client.responses.create({ model, input: "Sam ran home.", max_output_tokens: 12, temperature: 0, stream: true });
  const types = [];
  let seq = -1, text = "";
  for await (const ev of stream) {
    types.push(ev.type);
    assert.equal(ev.sequence_number, seq + 1);
    seq = ev.sequence_number;
    if (ev.type === "response.output_text.delta") text += ev.delta;
  }
  assert.equal(types[0], "response.created");
  assert.ok(["response.completed", "response.incomplete"].includes(types.at(-1)), types.at(-1));
  assert.ok(text.length > 0);
});

// The Open Responses provider validates every answer and event against the open
// specification's schemas.
const openResponses = () => createOpenResponses({ name: "infernode", url: next() + "/responses", apiKey })(model);

await check("open-responses generateText, streamText, tool call", async () => {
  const r = await generateText({ model: openResponses(), prompt: "Once upon a time", maxOutputTokens: 16, temperature: 0 });
  assert.ok(r.text.length > 0, "empty text");
  const s = streamText({ model: openResponses(), prompt: "Tom had a dog.", maxOutputTokens: 16, temperature: 0 });
  let text = "";
  for await (const piece of s.textStream) text += piece;
  assert.ok(text.length > 0, "empty stream");
  const c = await generateText({
    // Named, so one call (this provider has no parallel_tool_calls option).
    model: openResponses(), tools: { weather }, toolChoice: { type: "tool", toolName: "weather" }, maxOutputTokens: 100,
    temperature: 0, prompt: "What is the weather in Paris?",
  });
  assert.ok(c.toolCalls.length >= 1 && c.toolCalls[0].toolName === "weather", "no tool call");
});

const chat = () => new ChatOpenAI({ model, apiKey, configuration: { baseURL: next() }, temperature: 0, maxTokens: 120 });

await check("langchain withStructuredOutput", async () => {
  const schema = z.object({ title: z.string(), words: z.number().int() });
  const r = await chat().withStructuredOutput(schema).invoke("Name a story and count its words.");
  schema.parse(r);
});

await check("langchain bindTools", async () => {
  const m = chat().bindTools([{ type: "function", function: { name: "weather", description: "Get the weather",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } }], { tool_choice: "weather" });
  const r = await m.invoke("Weather in Rome?");
  assert.equal(r.tool_calls.length, 1);
  assert.equal(r.tool_calls[0].name, "weather");
  assert.equal(typeof r.tool_calls[0].args.city, "string");
});

console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
