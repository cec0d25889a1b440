/** Durations (milliseconds) and dates (Date) to and from their protobuf types. */
import { create } from "@bufbuild/protobuf";
import { type Duration, DurationSchema, type Timestamp, TimestampSchema } from "@bufbuild/protobuf/wkt";

export function toDuration(ms: number): Duration {
  if (!Number.isFinite(ms) || ms < 0) throw new RangeError(`a duration must be a finite, non-negative number of milliseconds, got ${ms}`);
  const whole = Math.floor(ms);
  const seconds = Math.floor(whole / 1000);
  const nanos = Math.round((ms - seconds * 1000) * 1e6);
  return create(DurationSchema, { seconds: BigInt(seconds), nanos });
}

export function fromDuration(duration: Duration | undefined): number {
  if (duration === undefined) return 0;
  return Number(duration.seconds) * 1000 + duration.nanos / 1e6;
}

export function toTimestamp(date: Date): Timestamp {
  const ms = date.getTime();
  if (!Number.isFinite(ms)) throw new RangeError("an invalid Date");
  const seconds = Math.floor(ms / 1000);
  return create(TimestampSchema, { seconds: BigInt(seconds), nanos: (ms - seconds * 1000) * 1e6 });
}

export function fromTimestamp(ts: Timestamp | undefined): Date | undefined {
  if (ts === undefined) return undefined;
  return new Date(Number(ts.seconds) * 1000 + Math.floor(ts.nanos / 1e6));
}

export function fromMicros(us: bigint): Date {
  return new Date(Number(us / 1000n));
}

const encoder = new TextEncoder();

/** A payload as bytes: strings are stored as UTF-8. */
export function payloadBytes(value: Uint8Array | string): Uint8Array {
  return typeof value === "string" ? encoder.encode(value) : value;
}
