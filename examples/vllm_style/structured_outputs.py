"""vLLM's offline "structured_outputs" example: choice, regex, JSON schema (pydantic) and grammar."""

from enum import Enum

from pydantic import BaseModel

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams


class CarType(str, Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


simplified_sql_grammar = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""

cases = {
    "choice": ("Classify this sentiment: vLLM is wonderful!",
               StructuredOutputsParams(choice=["Positive", "Negative"])),
    "regex": ("Generate an email address for Alan Turing, who works in Enigma. End in .com and new line. "
              "Example result: alan.turing@enigma.com\n", StructuredOutputsParams(regex=r"\w{1,20}@\w{1,10}\.com\n")),
    "json": ("Generate a JSON with the brand, model and car_type of the most iconic car from the 90's",
             StructuredOutputsParams(json=CarDescription.model_json_schema())),
    "grammar": ("Generate an SQL query to show the 'username' and 'email' from the 'users' table.",
                StructuredOutputsParams(grammar=simplified_sql_grammar)),
}


def main():
    llm = LLM(model="default", max_model_len=1024)
    for name, (prompt, constraint) in cases.items():
        params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint)
        output = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        print(f"{name}: {output.text!r} (finish_reason {output.finish_reason})")


if __name__ == "__main__":
    main()
