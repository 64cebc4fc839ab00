// llama.cpp on a GGUF file, through node-llama-cpp's prebuilt CPU binaries (no build, no GPU):
//   node llama_cpp.mjs greedy MODEL "ID ID ..." [N]     greedy continuation ids (compare with
//                                                       combs-generate --temperature 0 --ids)
//   node llama_cpp.mjs speed MODEL [PROMPT] [GEN] [VOCAB] [THREADS]
//                                                       prompt and decode tokens/s, 3 runs
// Set up once here: npm install (see README.md).
import {getLlama, LlamaLogLevel} from "node-llama-cpp";

const [mode, modelPath, ...rest] = process.argv.slice(2);
if ((mode !== "greedy" && mode !== "speed") || !modelPath) {
  console.error('usage: node llama_cpp.mjs greedy MODEL "ID ID ..." [N] | speed MODEL [PROMPT] [GEN] [VOCAB] [THREADS]');
  process.exit(2);
}
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath, gpuLayers: 0});

if (mode === "greedy") {
  const [ids, n = "32"] = rest;
  const ctx = await model.createContext({contextSize: 512, threads: 2, sequences: 1});
  const seq = ctx.getSequence();
  const out = [];
  for await (const tok of seq.evaluate(ids.trim().split(/\s+/).map(Number), {temperature: 0})) {
    out.push(tok);
    if (out.length >= +n) break;
  }
  console.log(out.join(" "));
} else {
  const [prompt = "512", gen = "64", vocab = "259", threads = "2"] = rest;
  const ctx = await model.createContext({contextSize: +prompt + +gen + 16, batchSize: 512, threads: +threads,
                                         sequences: 1, flashAttention: true});
  const seq = ctx.getSequence();
  // The same prompt as combs-bench model: token i = (i * 7919 + 13) mod vocab.
  const tokens = Array.from({length: +prompt}, (_, i) => (i * 7919 + 13) % +vocab);
  for (let rep = 0; rep < 3; ++rep) {
    await seq.clearHistory();
    const t0 = performance.now();
    await seq.evaluateWithoutGeneratingNewTokens(tokens);
    const t1 = performance.now();
    let n = 0;
    for await (const tok of seq.evaluate([tokens[0]], {temperature: 0})) {
      if (++n >= +gen) break;
    }
    const t2 = performance.now();
    console.log(`llama.cpp: prompt ${prompt} tokens ${(+prompt / ((t1 - t0) / 1000)).toFixed(1)} tok/s, ` +
                `decode ${n} tokens ${(n / ((t2 - t1) / 1000)).toFixed(2)} tok/s`);
  }
}
