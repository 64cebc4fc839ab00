// combs-server's OpenAI-compatible API driven by OpenAI's official Node client (npm's `openai`),
// a real foreign client: models, chat plain and streamed (the deltas add up to the plain text at
// temperature 0), text completions, stop strings, n = 3, and errors as the client's typed
// exceptions with their statuses.
//   usage: node openai_client_test.mjs CLIENT_DIR BASE_URL KEY MODEL
// CLIENT_DIR holds node_modules/openai (the test installs it there). Prints one line per check;
// exits 1 when one fails.
import { createRequire } from 'node:module';

const [clientDir, baseURL, apiKey, model] = process.argv.slice(2);
const require = createRequire(clientDir + '/');
const openai = require('openai');
const { OpenAI } = openai;

let failures = 0;
function check(ok, what, detail = '') {
  console.log(`${ok ? 'ok' : 'FAILED'}: ${what}${ok || !detail ? '' : ' -- ' + detail}`);
  if (!ok) failures++;
}

const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const messages = [
  { role: 'system', content: 'You are a test.' },
  { role: 'user', content: 'Say something.' },
];

const models = await client.models.list();
check(models.data.length === 1 && models.data[0].id === model, 'models.list names the served model', JSON.stringify(models.data));

const plain = await client.chat.completions.create({ model, messages, max_tokens: 12, temperature: 0 });
const text = plain.choices[0].message.content;
check(plain.object === 'chat.completion' && typeof text === 'string', 'chat.completions.create answers');
check(plain.usage.prompt_tokens > 0 && plain.usage.total_tokens === plain.usage.prompt_tokens + plain.usage.completion_tokens,
      'usage adds up', JSON.stringify(plain.usage));

const stream = await client.chat.completions.create({
  model, messages, max_tokens: 12, temperature: 0, stream: true, stream_options: { include_usage: true },
});
let joined = '';
let finish = null;
let usage = null;
for await (const chunk of stream) {
  if (chunk.choices.length > 0) {
    joined += chunk.choices[0].delta.content ?? '';
    finish = chunk.choices[0].finish_reason ?? finish;
  }
  if (chunk.usage) usage = chunk.usage;
}
check(joined === text, 'the streamed deltas add up to the plain text', JSON.stringify({ joined, text }));
check(finish === plain.choices[0].finish_reason, 'the stream ends with the same finish_reason', `${finish}`);
check(usage !== null && usage.prompt_tokens === plain.usage.prompt_tokens, 'the stream reports usage');
check(usage !== null && usage.prompt_tokens_details.cached_tokens > 0, 'the repeated prompt came from the prefix cache',
      JSON.stringify(usage));

const completion = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 16, temperature: 0 });
const ctext = completion.choices[0].text;
check(completion.object === 'text_completion' && ctext.length > 0, 'completions.create answers');
// A stop string of two ASCII characters from the middle of the greedy text.
let stop = '';
for (let i = Math.floor(ctext.length / 3); i + 1 < ctext.length && !stop; i++) {
  const s = ctext.slice(i, i + 2);
  if (/^[!-~]{2}$/.test(s)) stop = s;
}
if (stop) {
  const stopped = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 16, temperature: 0, stop: [stop] });
  check(stopped.choices[0].text === ctext.slice(0, ctext.indexOf(stop)) && stopped.choices[0].finish_reason === 'stop',
        'the text ends before the stop string', JSON.stringify({ stop, got: stopped.choices[0].text }));
} else {
  check(false, 'the greedy text has two ASCII characters to stop at', ctext);
}

const three = await client.chat.completions.create({ model, messages, max_tokens: 6, n: 3, temperature: 0.9, seed: 3 });
check(three.choices.length === 3 && three.choices.every((c, i) => c.index === i), 'n = 3 gives three choices');

async function status(promise) {
  try {
    await promise;
    return 200;
  } catch (e) {
    return e instanceof openai.APIError ? e.status : -1;
  }
}
check(await status(client.chat.completions.create({ model: 'no-such-model', messages })) === 404, 'an unknown model is 404');
check(await status(client.chat.completions.create({ model, messages, temperature: 5 })) === 400, 'a bad temperature is 400');
try {
  await client.chat.completions.create({ model, messages, temperature: 5 });
} catch (e) {
  check(e instanceof openai.BadRequestError && e.param === 'temperature', 'the error names the bad field', `${e.param}`);
}
const wrong = new OpenAI({ baseURL, apiKey: 'not-a-key', maxRetries: 0 });
check(await status(wrong.chat.completions.create({ model, messages })) === 401, 'a wrong key is 401');

process.exit(failures === 0 ? 0 : 1);
