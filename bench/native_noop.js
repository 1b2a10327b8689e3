// A no-op ext_proc processor without Python, for `kvgate bench path`'s floor: Node's HTTP/2 server
// (nghttp2, C) answering each ProcessingRequest with bytes serialized beforehand by bench.noop_processor
// (native_answers), so the time it adds is Envoy's ext_proc and one process hop, next to nothing else.
//
//     node bench/native_noop.js PORT ANSWERS_JSON
//
// ANSWERS_JSON maps the ProcessingRequest field Envoy sent (request_headers, request_body, response_headers,
// response_body) to the hex of the serialized ProcessingResponse to send back. A message of another kind
// (trailers) is answered by nothing; the stream ends with grpc-status 0 when Envoy ends it.
'use strict';
const fs = require('fs');
const http2 = require('http2');

const FIELDS = {2: 'request_headers', 3: 'response_headers', 4: 'request_body', 5: 'response_body'};

function framed(hex) {  // a gRPC message: flag byte 0 (not compressed), 4-byte big-endian length, the bytes
  const body = Buffer.from(hex, 'hex');
  const head = Buffer.alloc(5);
  head.writeUInt32BE(body.length, 1);
  return Buffer.concat([head, body]);
}

function varint(buf, at) {  // [value, next offset]; values here fit in 32 bits
  let value = 0, shift = 0;
  for (;;) {
    if (at >= buf.length) throw new Error('truncated varint');
    const b = buf[at++];
    value += (b & 0x7f) * 2 ** shift;
    if (!(b & 0x80)) return [value, at];
    shift += 7;
  }
}

function kind(msg) {  // the name of the ProcessingRequest's `request` field present, or null
  let at = 0;
  while (at < msg.length) {
    let tag;
    [tag, at] = varint(msg, at);
    const field = Math.floor(tag / 8), wire = tag & 7;
    if (FIELDS[field] && wire === 2) return FIELDS[field];
    if (wire === 0) [, at] = varint(msg, at);
    else if (wire === 2) { let n; [n, at] = varint(msg, at); at += n; }
    else if (wire === 1) at += 8;
    else if (wire === 5) at += 4;
    else throw new Error(`wire type ${wire}`);
  }
  return null;
}

const [port, answersPath] = process.argv.slice(2);
if (!port || !answersPath) {
  process.stderr.write('usage: node native_noop.js PORT ANSWERS_JSON\n');
  process.exit(2);
}
const raw = JSON.parse(fs.readFileSync(answersPath, 'utf8'));
const answers = {};
for (const name of Object.values(FIELDS)) {
  if (typeof raw[name] !== 'string') throw new Error(`${answersPath}: no answer for ${name}`);
  answers[name] = framed(raw[name]);
}

const server = http2.createServer();
server.on('stream', (stream) => {
  let pending = Buffer.alloc(0), responded = false;
  const respond = () => {
    if (!responded) {
      responded = true;
      stream.respond({':status': 200, 'content-type': 'application/grpc'}, {waitForTrailers: true});
    }
  };
  stream.on('wantTrailers', () => stream.sendTrailers({'grpc-status': '0'}));
  stream.on('data', (chunk) => {
    pending = pending.length ? Buffer.concat([pending, chunk]) : chunk;
    const out = [];
    while (pending.length >= 5) {
      const n = pending.readUInt32BE(1);
      if (pending.length < 5 + n) break;
      const name = kind(pending.subarray(5, 5 + n));
      pending = pending.subarray(5 + n);
      if (name) out.push(answers[name]);
    }
    if (out.length) {
      respond();
      stream.write(out.length === 1 ? out[0] : Buffer.concat(out));
    }
  });
  stream.on('end', () => { respond(); stream.end(); });
  stream.on('error', () => {});  // Envoy reset the stream (its request ended): nothing to answer
});
server.listen(Number(port), '127.0.0.1');
for (const sig of ['SIGINT', 'SIGTERM']) process.on(sig, () => process.exit(0));  // open HTTP/2 sessions hold no state
