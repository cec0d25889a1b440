/** Failure text: a thrown value as the `error` a Retry carries (the item's `lastError`). */

/** What the server keeps of a Retry's error text, in bytes of UTF-8 (RetryItem.error);
 * it cuts longer text and marks the cut. */
export const MAX_ERROR_BYTES = 2048;

const encoder = new TextEncoder();
const bytes = (text: string): number => encoder.encode(text).length;

/**
 * `error` as failure text: its name and message first (`TypeError: x is undefined`),
 * then the frames of its stack nearest to the throw, as many as fit in
 * MAX_ERROR_BYTES (a line says how many were left out). A message that alone passes
 * the bound is sent whole: the server cuts it and marks the cut. A thrown value that
 * is not an Error is sent as its String().
 */
export function failureText(error: unknown): string {
  if (!(error instanceof Error)) return String(error);
  const head = `${error.name}: ${error.message}`;
  // V8's stack: the head (the message may span lines), then "    at ..." lines, the
  // frame that threw first.
  const frames = (error.stack ?? "").split("\n").filter((line) => /^\s+at /.test(line));
  let size = bytes(head);
  if (size > MAX_ERROR_BYTES) return head;
  const kept: string[] = [];
  for (const frame of frames) {
    const leftOut = frames.length - kept.length - 1;
    const note = leftOut ? bytes(omitted(leftOut)) + 1 : 0;
    const cost = bytes(frame) + 1;
    if (size + cost + note > MAX_ERROR_BYTES) break;
    kept.push(frame);
    size += cost;
  }
  const leftOut = frames.length - kept.length;
  return [head, ...kept, ...(leftOut ? [omitted(leftOut)] : [])].join("\n");
}

function omitted(count: number): string {
  return `    ... ${count} more frame${count === 1 ? "" : "s"} left out`;
}
