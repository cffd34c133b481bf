// One chat completion with the OpenAI Node SDK; prints how the SDK classified the outcome as one JSON line.
// Usage: NODE_PATH=.node/node_modules node node_auth_check.cjs BASE_URL API_KEY
const OpenAI = require("openai");

const client = new OpenAI({ baseURL: process.argv[2], apiKey: process.argv[3], maxRetries: 0 });
client.chat.completions
  .create({ model: "glm-5.2", messages: [{ role: "user", content: "hi" }], max_tokens: 3 })
  .then((r) => console.log(JSON.stringify({ ok: true, content: r.choices[0].message.content })))
  .catch((e) => console.log(JSON.stringify({
    ok: false, name: e.constructor.name, auth: e instanceof OpenAI.AuthenticationError,
    status: e.status, code: e.code, type: e.type, message: e.message,
  })));
