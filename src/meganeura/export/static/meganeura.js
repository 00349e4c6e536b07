// meganeura web runtime: runs a plan exported by `meganeura export --web` (or
// Session.export_web) with WebGPU. A dependency-free ES module:
//
//   import { load } from "./meganeura.js";
//   const model = await load(".");                          // plan.json + weights.safetensors
//   const [logits] = await model.run({ x: new Float32Array(64) });
//
// The plan is the Python compiler's, serialized: kernels as WGSL, the dispatch list, the
// buffer plan (named tensors, memory slots shared by intermediates, constants, targets),
// where each output lives and the state copies recorded after each call. The weights are
// uploaded once; each run writes the feeds, records every dispatch in one compute pass,
// copies new state values and the outputs, and submits once.

export const FORMAT = "meganeura-web";
export const FORMAT_VERSION = 1;

export class WebGPUUnavailableError extends Error {
  constructor(message) { super(message); this.name = "WebGPUUnavailableError"; }
}

// limits requested at the adapter's maximum (kernels were compiled for WebGPU's defaults,
// large models need the bigger buffers)
const WANTED_LIMITS = [
  "maxStorageBufferBindingSize", "maxBufferSize", "maxComputeWorkgroupStorageSize",
  "maxComputeInvocationsPerWorkgroup", "maxComputeWorkgroupSizeX", "maxComputeWorkgroupSizeY",
  "maxComputeWorkgroupSizeZ", "maxComputeWorkgroupsPerDimension", "maxStorageBuffersPerShaderStage",
];
const SAFETENSORS_DTYPES = { F32: "f32", F16: "f16", I32: "i32", U32: "u32" };
const ITEMSIZE = { f32: 4, f16: 2, i32: 4, u32: 4 };

const round4 = (n) => Math.max(4, (n + 3) & ~3);
const prod = (shape) => shape.reduce((a, b) => a * b, 1);
const fmtShape = (shape) => "(" + shape.join(", ") + (shape.length === 1 ? ",)" : ")");

// ------------------------------------------------------------------------- f16 <-> f32
const f32buf = new Float32Array(1);
const u32buf = new Uint32Array(f32buf.buffer);

export function halfToFloat(h) {
  const s = (h & 0x8000) ? -1 : 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e === 0) return s * m * 2 ** -24;
  if (e === 31) return m ? NaN : s * Infinity;
  return s * (1 + m / 1024) * 2 ** (e - 15);
}

export function floatToHalf(x) {
  // round to nearest even, as numpy's astype(float16)
  f32buf[0] = x;
  const b = u32buf[0], sign = (b >>> 16) & 0x8000, e = (b >>> 23) & 0xff, m = b & 0x7fffff;
  if (e === 0xff) return sign | 0x7c00 | (m ? 0x200 : 0);
  const ue = e - 127 + 15;
  if (ue >= 31) return sign | 0x7c00;
  if (ue <= 0) {
    if (ue < -10) return sign;
    const mm = m | 0x800000, shift = 14 - ue;
    let r = mm >>> shift;
    const rem = mm & ((1 << shift) - 1), half = 1 << (shift - 1);
    if (rem > half || (rem === half && (r & 1))) r += 1;
    return sign | r;
  }
  let r = (ue << 10) | (m >>> 13);
  const rem = m & 0x1fff;
  if (rem > 0x1000 || (rem === 0x1000 && (r & 1))) r += 1;
  return sign | r;
}

// ------------------------------------------------------------------------- safetensors
/** Parse a safetensors file: {name: {dtype, shape, bytes: Uint8Array}} and its metadata. */
export function parseSafetensors(buffer, what = "weights") {
  if (buffer.byteLength < 8) throw new Error(`${what}: ${buffer.byteLength} bytes is too short for a safetensors file`);
  const n = Number(new DataView(buffer).getBigUint64(0, true));
  if (8 + n > buffer.byteLength) throw new Error(`${what}: header of ${n} bytes runs past the end of the file`);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 8, n)));
  const base = 8 + n, tensors = {};
  for (const [name, e] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const dtype = SAFETENSORS_DTYPES[e.dtype];
    if (!dtype) throw new Error(`${what}: tensor '${name}' has dtype ${e.dtype}; supported: ${Object.keys(SAFETENSORS_DTYPES).join(", ")}`);
    const [a, b] = e.data_offsets;
    if (base + b > buffer.byteLength || b - a !== prod(e.shape) * ITEMSIZE[dtype])
      throw new Error(`${what}: tensor '${name}' ${fmtShape(e.shape)} ${e.dtype} has a bad data range [${a}, ${b})`);
    tensors[name] = { dtype, shape: e.shape, bytes: new Uint8Array(buffer, base + a, b - a) };
  }
  return { tensors, metadata: header.__metadata__ || {} };
}

// ------------------------------------------------------------------------- feeds
function toBytes(name, info, value) {
  // a feed as the bytes of the tensor's dtype, or a clear error
  const n = prod(info.shape);
  const len = value == null ? -1 : value.length;
  if (len !== n)
    throw new Error(`input '${name}': got ${len < 0 ? "nothing" : len + " values"}, expected ${n} (shape ${fmtShape(info.shape)} ${info.dtype})`);
  let arr;
  if (info.dtype === "f32") arr = value instanceof Float32Array ? value : Float32Array.from(value);
  else if (info.dtype === "f16") arr = value instanceof Uint16Array ? value : Uint16Array.from(value, floatToHalf);
  else {
    const Typed = info.dtype === "i32" ? Int32Array : Uint32Array;
    if (value instanceof Typed) arr = value;
    else {
      if (value instanceof Float32Array || value instanceof Float64Array)
        throw new TypeError(`input '${name}': got a float array, expected integers (${info.dtype})`);
      arr = new Typed(n);
      const lo = info.dtype === "i32" ? -(2 ** 31) : 0, hi = info.dtype === "i32" ? 2 ** 31 - 1 : 2 ** 32 - 1;
      for (let i = 0; i < n; i++) {
        const v = Number(value[i]);
        if (!Number.isInteger(v) || v < lo || v > hi)
          throw new TypeError(`input '${name}': value ${value[i]} at ${i} is not an ${info.dtype}`);
        arr[i] = v;
      }
    }
  }
  return padded(new Uint8Array(arr.buffer, arr.byteOffset, arr.byteLength));
}

function padded(bytes) {
  // queue.writeBuffer needs a size that is a multiple of 4
  if (bytes.byteLength % 4 === 0 && bytes.byteOffset % 4 === 0) return bytes;
  const out = new Uint8Array(round4(bytes.byteLength));
  out.set(bytes);
  return out;
}

function fromBytes(dtype, bytes) {
  const copy = bytes.slice();     // its own, aligned ArrayBuffer
  if (dtype === "f32") return new Float32Array(copy.buffer);
  if (dtype === "i32") return new Int32Array(copy.buffer);
  if (dtype === "u32") return new Uint32Array(copy.buffer);
  return Float32Array.from(new Uint16Array(copy.buffer), halfToFloat);
}

async function fetchOk(url, how) {
  let r;
  try { r = await fetch(url); } catch (e) { throw new Error(`could not fetch ${url}: ${e.message}`); }
  if (!r.ok) throw new Error(`could not fetch ${url}: HTTP ${r.status}`);
  return how === "json" ? r.json() : r.arrayBuffer();
}

// ------------------------------------------------------------------------- loading
/**
 * Load an exported model from `base` (a URL of the export folder). Options: `adapter`
 * (requestAdapter options), `precision` ("strict" to skip an f16 variant), `plan` / `weights`
 * (already fetched plan object / ArrayBuffer). Resolves to a Model; rejects with a
 * WebGPUUnavailableError when the browser has no WebGPU or no adapter.
 */
export async function load(base = ".", options = {}) {
  if (typeof navigator === "undefined" || !navigator.gpu)
    throw new WebGPUUnavailableError(
      "WebGPU is not available in this browser (navigator.gpu is missing). Use a browser with WebGPU " +
      "(Chrome or Edge 113+, Safari 26+, Firefox 141+ on Windows), open the page over https or from localhost, " +
      "and on Linux start Chrome with --enable-unsafe-webgpu --enable-features=Vulkan.");
  const adapter = await navigator.gpu.requestAdapter(options.adapter || {});
  if (!adapter)
    throw new WebGPUUnavailableError(
      "WebGPU is present but no GPU adapter was found (blocklisted GPU or driver, or no Vulkan/Metal/D3D12 " +
      "driver); see chrome://gpu, or try --enable-unsafe-webgpu.");
  const root = base.endsWith("/") ? base : base + "/";
  const plan = options.plan || await fetchOk(root + "plan.json", "json");
  if (plan.format !== FORMAT || plan.version !== FORMAT_VERSION)
    throw new Error(`plan.json: format ${plan.format} version ${plan.version}; this runtime reads ${FORMAT} version ${FORMAT_VERSION}`);
  const features = new Set(adapter.features);
  let variants = plan.variants;
  if (options.precision) variants = variants.filter((v) => v.precision === options.precision);
  const variant = variants.find((v) => v.requires.every((f) => features.has(f)));
  if (!variant) {
    const missing = [...new Set(variants.flatMap((v) => v.requires.filter((f) => !features.has(f))))];
    throw new Error(`this model needs the WebGPU feature(s) ${missing.join(", ")}, which this adapter lacks` +
                    (options.precision ? ` (precision '${options.precision}' was asked for)` : ""));
  }
  const notes = [];
  if (variant !== plan.variants[0])
    notes.push(`the adapter lacks ${plan.variants[0].requires.join(", ")}: running the ${variant.precision} (f32) plan ` +
               `instead of the ${plan.variants[0].precision} one`);
  const requiredLimits = {};
  for (const k of WANTED_LIMITS) if (adapter.limits[k] !== undefined) requiredLimits[k] = adapter.limits[k];
  const device = await adapter.requestDevice({ requiredFeatures: variant.requires, requiredLimits });
  const weights = options.weights || await fetchOk(root + plan.weights);
  const model = new Model(device, adapter, plan, variant, parseSafetensors(weights, plan.weights).tensors, notes);
  await model._build();
  return model;
}

export class Model {
  constructor(device, adapter, plan, variant, weights, notes) {
    this.device = device;
    this.adapter = adapter;
    this.plan = plan;
    this.variant = variant;
    this.precision = variant.precision;
    this.notes = notes;
    this.weights = weights;
    this.lost = null;
    this.lastRunMs = 0;
    this._queue = Promise.resolve();
    device.lost.then((info) => { this.lost = info; });
    this.programNames = Object.keys(variant.programs);
    this.inputs = Object.fromEntries(Object.entries(plan.tensors).filter(([, t]) => t.kind === "input"));
  }

  /** Outputs of `program` (default: the first): [{name, shape, dtype}]. */
  outputs(program) {
    return this._program(program).spec.outputs.map(({ name, shape, dtype }) => ({ name, shape, dtype }));
  }

  async _build() {
    const dev = this.device, plan = this.plan;
    dev.pushErrorScope("validation");
    dev.pushErrorScope("out-of-memory");
    // named tensors (inputs, parameters, state): one buffer each, shared by every program
    this.named = {};
    for (const [name, t] of Object.entries(plan.tensors)) {
      this.named[name] = dev.createBuffer({
        label: name, size: round4(t.nbytes),
        usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC,
      });
      if (t.kind !== "input" && t.fill === undefined) {
        const w = this.weights[name];
        if (!w) throw new Error(`${plan.weights}: tensor '${name}' ${fmtShape(t.shape)} ${t.dtype} is missing`);
        if (w.dtype !== t.dtype || w.shape.join() !== t.shape.join())
          throw new Error(`${plan.weights}: tensor '${name}' is ${fmtShape(w.shape)} ${w.dtype}, ` +
                          `the plan expects ${fmtShape(t.shape)} ${t.dtype}`);
      }
    }
    this.reset(true);
    // pipelines: one per distinct kernel, with the layout its WGSL declares
    const shaderIds = new Set(Object.values(this.variant.programs).flatMap((p) => p.dispatches.map((d) => d.shader)));
    const firstName = {};
    for (const p of Object.values(this.variant.programs)) for (const d of p.dispatches) firstName[d.shader] ??= d.name;
    this.pipelines = {};
    await Promise.all([...shaderIds].map(async (sid) => {
      const sh = plan.shaders[sid], label = firstName[sid];
      const module = dev.createShaderModule({ label, code: sh.wgsl });
      const info = await module.getCompilationInfo();
      const errors = info.messages.filter((m) => m.type === "error");
      if (errors.length)
        throw new Error(`kernel '${label}' (shader ${sid}) does not compile: ` +
                        errors.map((m) => `${m.lineNum}:${m.linePos} ${m.message}`).join("; "));
      const layout = dev.createBindGroupLayout({
        label, entries: sh.access.map((a, i) => ({
          binding: i, visibility: GPUShaderStage.COMPUTE,
          buffer: { type: a === "read" ? "read-only-storage" : "storage" },
        })),
      });
      const pipeline = await dev.createComputePipelineAsync({
        label, layout: dev.createPipelineLayout({ bindGroupLayouts: [layout] }),
        compute: { module, entryPoint: "main" },
      });
      this.pipelines[sid] = { pipeline, layout };
    }));
    this.programs = {};
    for (const [pname, spec] of Object.entries(this.variant.programs)) this.programs[pname] = this._bind(pname, spec);
    const oom = await dev.popErrorScope();
    const err = await dev.popErrorScope();
    if (oom || err) throw new Error(`setting up the model on ${this.adapterName()}: ${(oom || err).message}`);
  }

  _bind(pname, spec) {
    // the program's buffers, bind groups and readback buffers, as the Python executor's Plan
    const dev = this.device, storage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
    const slots = spec.slots.map((n, i) => dev.createBuffer({ label: `${pname}.slot${i}`, size: round4(n), usage: storage }));
    const phys = spec.buffers.map((b) => {
      if (b.kind === "named") return this.named[b.name];
      if (b.kind === "slot") return slots[b.slot];
      const buf = dev.createBuffer({ label: `${pname}.${b.name}`, size: round4(b.nbytes), usage: storage });
      if (b.kind === "constant")
        dev.queue.writeBuffer(buf, 0, padded(Uint8Array.from(atob(b.data), (c) => c.charCodeAt(0))));
      return buf;
    });
    const steps = spec.dispatches.map((d) => {
      const { pipeline, layout } = this.pipelines[d.shader];
      const bindGroup = dev.createBindGroup({
        label: d.name, layout, entries: d.bindings.map((bi, i) => ({ binding: i, resource: { buffer: phys[bi] } })),
      });
      return { pipeline, bindGroup, groups: d.groups };
    });
    const staging = spec.outputs.map((o) => dev.createBuffer({
      label: `${pname}.fetch.${o.name}`, size: round4(o.nbytes), usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
    }));
    return { spec, phys, steps, staging };
  }

  _program(name) {
    const pname = name ?? this.programNames[0];
    const p = this.programs[pname];
    if (!p) throw new Error(`unknown program '${name}'; this model has ${this.programNames.join(", ")}`);
    return p;
  }

  adapterName() {
    const i = this.adapter.info || {};
    return [i.vendor, i.architecture, i.device, i.description].filter(Boolean).join(" ") || "the WebGPU adapter";
  }

  /** State (a KV cache) back to its exported value; parameters too with `all`. */
  reset(all = false) {
    for (const [name, t] of Object.entries(this.plan.tensors)) {
      if (t.kind === "input" || (t.kind === "parameter" && !all)) continue;
      let bytes;
      if (t.fill !== undefined) {
        const n = prod(t.shape), Typed = { f32: Float32Array, i32: Int32Array, u32: Uint32Array, f16: Uint16Array }[t.dtype];
        const arr = new Typed(n).fill(t.dtype === "f16" ? floatToHalf(t.fill) : t.fill);
        bytes = new Uint8Array(arr.buffer);
      } else bytes = this.weights[name].bytes;
      if (bytes.byteLength) this.device.queue.writeBuffer(this.named[name], 0, padded(bytes));
    }
  }

  /**
   * Run `program` (default: the first) on `feeds` ({input name: typed array or array, of
   * the input's size, row-major}); resolves to the outputs in order as Float32Array /
   * Int32Array / Uint32Array (f16 outputs are widened to Float32Array). State updates (a
   * KV cache) stay on the device for the next call. Calls run one at a time.
   */
  run(feeds, { program } = {}) {
    const job = this._queue.then(() => this._run(feeds, program));
    this._queue = job.catch(() => {});
    return job;
  }

  async _run(feeds, program) {
    if (this.lost) throw new Error(`the WebGPU device was lost: ${this.lost.message}`);
    const p = this._program(program), spec = p.spec, dev = this.device;
    if (feeds === null || typeof feeds !== "object") throw new TypeError("run: feeds must be an object of input name -> array");
    const unknown = Object.keys(feeds).filter((n) => !this.inputs[n]);
    if (unknown.length)
      throw new Error(`unknown input(s) ${unknown.join(", ")}; this model's inputs are ${Object.keys(this.inputs).join(", ")}`);
    const missing = spec.reads.filter((n) => !(n in feeds));
    if (missing.length)
      throw new Error("missing input(s): " + missing.map((n) => `'${n}' ${fmtShape(this.inputs[n].shape)} ${this.inputs[n].dtype}`).join(", "));
    const data = Object.entries(feeds).map(([n, v]) => [n, toBytes(n, this.inputs[n], v)]);
    const t0 = performance.now();
    dev.pushErrorScope("validation");
    for (const [n, bytes] of data) dev.queue.writeBuffer(this.named[n], 0, bytes);
    const enc = dev.createCommandEncoder();
    const pass = enc.beginComputePass();
    let lastPipe = null, lastBg = null;
    for (const s of p.steps) {
      if (s.pipeline !== lastPipe) { pass.setPipeline(s.pipeline); lastPipe = s.pipeline; lastBg = null; }
      if (s.bindGroup !== lastBg) { pass.setBindGroup(0, s.bindGroup); lastBg = s.bindGroup; }
      pass.dispatchWorkgroups(s.groups[0], s.groups[1], s.groups[2]);
    }
    pass.end();
    for (const u of spec.updates)       // new state values first, then the outputs (as the executor)
      enc.copyBufferToBuffer(p.phys[u.buffer], u.offset, this.named[u.state], 0, round4(u.nbytes));
    spec.outputs.forEach((o, i) => enc.copyBufferToBuffer(p.phys[o.buffer], o.offset, p.staging[i], 0, round4(o.nbytes)));
    dev.queue.submit([enc.finish()]);
    const err = await dev.popErrorScope();
    if (err) throw new Error(`run: ${err.message}`);
    await Promise.all(p.staging.map((b) => b.mapAsync(GPUMapMode.READ)));
    const out = spec.outputs.map((o, i) => {
      const bytes = new Uint8Array(p.staging[i].getMappedRange(), 0, o.nbytes);
      const arr = fromBytes(o.dtype, bytes);
      p.staging[i].unmap();
      return arr;
    });
    this.lastRunMs = performance.now() - t0;
    return out;
  }

  /** Free the device buffers. */
  destroy() {
    this.device.destroy();
  }
}

// ------------------------------------------------------------------------- text helpers
/** RoPE tables (cos, sin) of one position, as the Python decoder computes them (f64, then f32). */
export function ropeTables(pos, headDim, theta) {
  const half = headDim / 2, cos = new Float32Array(headDim), sin = new Float32Array(headDim);
  for (let i = 0; i < half; i++) {
    const ang = pos * (1.0 / theta ** ((2 * i) / headDim));
    cos[i] = cos[i + half] = Math.cos(ang);
    sin[i] = sin[i + half] = Math.sin(ang);
  }
  return { cos, sin };
}

/** The position inputs of one decoding step (one token at `pos`, a cache of `maxLen`). */
export function decodeFeeds(pos, maxLen, headDim, theta) {
  const { cos, sin } = ropeTables(pos, headDim, theta);
  const mask = new Float32Array(maxLen), write = new Float32Array(maxLen);
  for (let m = 0; m < maxLen; m++) { mask[m] = m <= pos ? 0 : -Infinity; write[m] = m === pos ? 1 : 0; }
  return { rope_cos: cos, rope_sin: sin, attn_mask: mask, cache_write: write };
}

/**
 * Greedy decoding with an exported text model (program "decode"): the prompt ids are fed
 * one at a time, then each argmax; `onToken(id)` sees every new token. Resolves to
 * {ids, logits} (logits: one Float32Array per step, prompt steps included).
 */
export async function generate(model, promptIds, maxNewTokens, { onToken, keepLogits = false } = {}) {
  const d = model.plan.demo;
  if (!promptIds.length) throw new Error("generate: the prompt has no tokens");
  if (promptIds.length + maxNewTokens > d.max_len)
    throw new Error(`generate: ${promptIds.length} prompt + ${maxNewTokens} new tokens do not fit the exported cache of ${d.max_len}`);
  const eos = new Set(d.eos_token_id || []);
  model.reset();
  const ids = [], logits = [];
  let last = null;
  for (let pos = 0; ; pos++) {
    const tok = pos < promptIds.length ? promptIds[pos] : argmax(last);
    if (pos >= promptIds.length) {
      ids.push(tok);
      if (onToken) onToken(tok);
      if (ids.length === maxNewTokens || eos.has(tok)) break;
    }
    const [out] = await model.run({ input_ids: Int32Array.of(tok), ...decodeFeeds(pos, d.max_len, d.head_dim, d.rope_theta) },
                                  { program: "decode" });
    if (keepLogits) logits.push(out);
    last = out;
  }
  return { ids, logits };
}

export function argmax(a) {
  let best = 0;
  for (let i = 1; i < a.length; i++) if (a[i] > a[best]) best = i;
  return best;
}
