// The official `openai` npm client against the gateway, unmodified: chat, chat streaming,
// completions, models and an error case. Env: BASE (gateway URL), MODEL_NAME, OPENAI_PKG (path
// of the installed package's entry). Prints PASS or throws.
import assert from "node:assert/strict";

const { default: OpenAI } = await import(process.env.OPENAI_PKG);
const client = new OpenAI({ baseURL: process.env.BASE + "/v1", apiKey: "unused", maxRetries: 0 });
const model = process.env.MODEL_NAME;

const models = await client.models.list();
assert.equal(models.data[0].id, model);

const chat = await client.chat.completions.create({
  model, messages: [{ role: "system", content: "Be brief." }, { role: "user", content: "Hi" }],
  max_tokens: 5, seed: 42, temperature: 0.7,
});
assert.equal(chat.object, "chat.completion");
assert.equal(chat.choices[0].message.role, "assistant");
assert.equal(typeof chat.choices[0].message.content, "string");
assert.equal(chat.usage.completion_tokens, chat.choices[0].finish_reason === "length" ? 5 : chat.usage.completion_tokens);

// The same seeded request streamed gives the same text.
const stream = await client.chat.completions.create({
  model, messages: [{ role: "system", content: "Be brief." }, { role: "user", content: "Hi" }],
  max_tokens: 5, seed: 42, temperature: 0.7, stream: true, stream_options: { include_usage: true },
});
let text = "", finish = null, usage = null;
for await (const chunk of stream) {
  for (const c of chunk.choices) {
    text += c.delta.content ?? "";
    if (c.finish_reason) finish = c.finish_reason;
  }
  if (chunk.usage) usage = chunk.usage;
}
assert.equal(text, chat.choices[0].message.content);
assert.equal(finish, chat.choices[0].finish_reason);
assert.equal(usage.completion_tokens, chat.usage.completion_tokens);

const cmpl = await client.completions.create({ model, prompt: "Hello world", max_tokens: 4, temperature: 0 });
assert.equal(cmpl.object, "text_completion");
assert.equal(cmpl.usage.completion_tokens <= 4, true);

// An error reaches the client as an APIError with OpenAI's fields.
await assert.rejects(
  client.completions.create({ model, prompt: "x", temperature: 7 }),
  (e) => e instanceof OpenAI.APIError && e.status === 400 && e.param === "temperature" &&
         e.type === "invalid_request_error");
await assert.rejects(
  client.completions.create({ model: "no-such-model", prompt: "x" }),
  (e) => e instanceof OpenAI.NotFoundError && e.code === "model_not_found");
console.log("PASS");
